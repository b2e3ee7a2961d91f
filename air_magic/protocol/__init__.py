"""protocol/: what the kernel side and the rank side share -- messages and records (messages),
a pool's messages (pool), the launch folder's files (paths), signals and stack requests
(processes), spool lines and files (spool_lines, spool), private folders (private), the tail
reader (tail).
Imports the standard library only: nothing else of air_magic, no third-party package.

What travels, and where::

    kernel (kernel/, backends/local)        helper (rank/zygote)             rank (rank/main)
    --------------------------------        --------------------             ----------------
    StartLaunch(LaunchRequest) ---------->  fork world_size ranks ------->  reads the request
    Stop(id, reason), Shutdown() -------->  signals them
           <-------------------  Ready(), Started(id, pids), Exited(id, rank, rc, at),
                                 Stopping(id, reason, at), Done(id), StartFailed(id, text)
    reads result_path(work_dir, r)  <---------------------------------------  ValueRecord /
                                                                             ErrorRecord /
                                                                             UnpicklableRecord
    tails log files and spool files <----------  rank-<r>.log, tracking-<r>.tsv (spool lines)

Messages go over a ``multiprocessing`` connection as plain tuples ``(KIND, *fields)``
(:func:`encode` / :func:`decode`): either side works with the named types, and the
wire stays what it always was.  Records are pickled into the launch's private folder.
"""

from __future__ import annotations

from air_magic.protocol.messages import (
    RESULT_NAME,
    STOP_MARK,
    TRACEBACK_MARK,
    Done,
    ErrorRecord,
    Exited,
    LaunchRequest,
    Message,
    Ready,
    Record,
    Shutdown,
    Started,
    StartFailed,
    StartLaunch,
    Stop,
    Stopping,
    ToHelper,
    ToKernel,
    UnpicklableRecord,
    ValueRecord,
    decode,
    encode,
)
from air_magic.protocol.paths import (
    LEFT_PREFIX,
    collectives_path,
    elastic_error_path,
    joined_path,
    left_path,
    log_dir,
    log_path,
    payload_path,
    rendezvous_path,
    result_path,
    spool_file,
    spool_file_name,
    spool_file_rank,
    stack_path,
    stack_request_path,
    stderr_ranges_path,
)
from air_magic.protocol.processes import (
    FINAL_STACK_SIGNAL,
    INTERRUPTED_EXIT,
    LAUNCH_ID_ENV,
    STACK_SIGNAL,
    STOP_ESCALATION,
    THREAD_ANSWER_SECONDS,
    StackAsk,
    ask_for_collectives,
    ask_for_stacks,
    ask_to_cut,
    carriers,
    end_carriers,
    format_thread_stacks,
    pid_limits,
    pids_room,
    printable,
    signal_rank,
)
from air_magic.protocol.spool_lines import (
    ARTIFACT,
    CALL,
    CALL_END,
    METRIC,
    PARAM,
    TAG,
    call_end_line,
    call_line,
    metric_line,
    parse_line,
    text_field,
    text_line,
)
from air_magic.protocol.tail import (
    TailReader,
    file_size,
)

__all__ = [
    "RESULT_NAME",
    "TRACEBACK_MARK",
    "STOP_MARK",
    "LaunchRequest",
    "StartLaunch",
    "Stop",
    "Shutdown",
    "Ready",
    "Started",
    "Exited",
    "Stopping",
    "Done",
    "StartFailed",
    "ToHelper",
    "ToKernel",
    "Message",
    "_BY_KIND",
    "encode",
    "decode",
    "ValueRecord",
    "ErrorRecord",
    "UnpicklableRecord",
    "Record",
    "payload_path",
    "log_dir",
    "log_path",
    "result_path",
    "stderr_ranges_path",
    "stack_path",
    "stack_request_path",
    "joined_path",
    "LEFT_PREFIX",
    "left_path",
    "rendezvous_path",
    "elastic_error_path",
    "spool_file_name",
    "spool_file",
    "spool_file_rank",
    "STACK_SIGNAL",
    "FINAL_STACK_SIGNAL",
    "INTERRUPTED_EXIT",
    "STOP_ESCALATION",
    "signal_rank",
    "LAUNCH_ID_ENV",
    "carriers",
    "end_carriers",
    "printable",
    "THREAD_ANSWER_SECONDS",
    "ask_for_stacks",
    "StackAsk",
    "ask_for_collectives",
    "ask_to_cut",
    "collectives_path",
    "format_thread_stacks",
    "pid_limits",
    "pids_room",
    "METRIC",
    "PARAM",
    "TAG",
    "ARTIFACT",
    "CALL",
    "CALL_END",
    "call_line",
    "call_end_line",
    "text_field",
    "_text",
    "metric_line",
    "text_line",
    "parse_line",
    "_open_for_reading",
    "TailReader",
    "file_size",
]
