"""Run named mcore checks (measurements included) on 2 gloo ranks and print each one's info as JSON.

.venv/bin/python tests/integrations/megatron/mcore_measure.py gpt_dp2_fp4_ablation [more names]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def main(names: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    import mcore_harness as H

    with tempfile.TemporaryDirectory() as out:
        run = H.launch(2, names, Path(out), timeout=1800)
        for n in names:
            print(n, json.dumps(H.info(run, n), indent=1, default=str))
        fails = H.failures(run, names)
    print("\n".join(fails) or f"ok ({run['seconds']} s)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
