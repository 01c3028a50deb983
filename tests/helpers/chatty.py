"""Prints its pid, then more lines than a pipe holds, and exits 0 (for the launcher's tests)."""

import os

print("PID", os.getpid(), flush=True)
for i in range(20000):
    print(f"line {i} " + "x" * 100)
print("DONE")
