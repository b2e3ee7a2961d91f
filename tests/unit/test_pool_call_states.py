"""A pool call's rank states: one named set, each said to the user in one word."""

from __future__ import annotations

import json

from air_magic.kernel.pool.call import RankCallState
from air_magic.kernel.pool.view import CALL_STATES


def test_every_state_a_rank_can_be_in_has_the_word_a_launch_s_rank_says() -> None:
    assert set(CALL_STATES) == set(RankCallState)
    assert CALL_STATES[RankCallState.INTERRUPTED] == "stopped" and CALL_STATES[RankCallState.DONE] == "finished"


def test_a_state_is_its_plain_word_in_status_dicts_and_json() -> None:
    assert RankCallState.ENDED == "ended" and str(RankCallState.ENDED) == "ended"
    assert json.dumps({"rank_states": [RankCallState.RUNNING, RankCallState.DONE]}) == (
        '{"rank_states": ["running", "done"]}'
    )
    assert f"{RankCallState.STOPPED}" == "stopped"
