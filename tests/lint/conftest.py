import os

# Lint tests start no processes unless marked: decorating must not warm the helper.
os.environ["AIR_MAGIC_WARM"] = "0"
