"""The example's prompts: small sums as chat messages, with the answer in a column of its own.

    python examples/byo/make_questions.py --out byo/questions.jsonl

Each line is {"prompt": [{"role": "user", "content": "What is 7 + 8?"}], "answer": "15"}; the
`answer` column reaches the reward function as a keyword argument.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from make_model import question


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSONL file to write")
    p.add_argument("--rows", type=int, default=512, help="questions (default 512)")
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(question(rng)) + "\n" for _ in range(args.rows)))
    print(f"wrote {out}: {args.rows} questions")


if __name__ == "__main__":
    main()
