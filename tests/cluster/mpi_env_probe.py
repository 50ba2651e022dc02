"""Run under mpirun: print what common.env detects, with and without the OMPI_COMM_WORLD_* variables.

Without them only PMIX_RANK is left, so world size and local rank must come from mpi4py. Each rank
writes its JSON to $PROBE_DIR/rank<N>.json (mpirun's merged stdout can interleave the ranks' lines).
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.env import detect_env  # noqa: E402

full = detect_env()
stripped = {k: v for k, v in os.environ.items()
            if not k.startswith(("OMPI_COMM_WORLD_", "OMPI_UNIVERSE_SIZE", "MASTER_"))}
fallback = detect_env(stripped)
out = Path(os.environ["PROBE_DIR"]) / f"rank{full.rank}.json"
out.write_text(json.dumps({"full": full.to_dict(), "mpi4py": fallback.to_dict()}))
