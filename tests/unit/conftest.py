import os

# Unit tests start no processes: do not warm the helper at decoration.
os.environ["AIR_MAGIC_WARM"] = "0"
