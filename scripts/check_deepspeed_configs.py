"""Loads every DeepSpeed config (*.json) under a directory and says what became of each.

    python scripts/check_deepspeed_configs.py DIR [--quiet]

Each config either loads, is refused naming the feature Tiers does not have, or needs an integration (HF Trainer,
accelerate) to fill its "auto" values; an "unknown key" outcome would be a gap in the loader
(Note [reading a DeepSpeed config]). JSON files that are not DeepSpeed configs (none of the keys below) are skipped,
and so are files that are not valid JSON (templates with placeholders). Prints one line per config and the totals;
exits 1 if any config fails as an unknown key.
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.config import ConfigError, load_config

DEEPSPEED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "zero_optimization", "optimizer", "fp16",
                  "bf16")


class Outcome(enum.Enum):
    LOADS = "loads"
    REFUSED = "refused"
    NEEDS_INTEGRATION = "needs an integration for \"auto\""
    UNKNOWN_KEY = "unknown key"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: str = ""  # the key or feature refused, the "auto" keys, or the unknown key


def is_deepspeed_config(raw: object) -> bool:
    return isinstance(raw, dict) and any(key in raw for key in DEEPSPEED_KEYS)


def classify(raw: dict) -> Verdict:
    """What load_config makes of one DeepSpeed config."""
    try:
        load_config(raw)
    except ConfigError as e:
        message = str(e)
        subject = message.split(": ", 1)[0]
        if "unknown key" in message:
            return Verdict(Outcome.UNKNOWN_KEY, subject)
        if '"auto" with nothing to derive it from' in message:
            return Verdict(Outcome.NEEDS_INTEGRATION, subject)
        return Verdict(Outcome.REFUSED, subject)
    return Verdict(Outcome.LOADS)


# what the HF Trainer would put for each "auto" (from TrainingArguments' defaults); train_batch_size is then derived
HF_FILLS = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "enabled": False, "lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
            "warmup_min_lr": 0.0, "warmup_max_lr": 5e-5, "warmup_num_steps": 0, "total_num_steps": 1000}


def filled_like_hf_trainer(value: object, key: str = "") -> object:
    """`value` with each "auto" replaced as the HF Trainer would (a number from its arguments' defaults)."""
    if isinstance(value, dict):
        return {k: filled_like_hf_trainer(v, k) for k, v in value.items() if not (k == "train_batch_size" and
                                                                                 v == "auto")}
    return HF_FILLS.get(key, value) if value == "auto" else value


def has_auto(value: object) -> bool:
    if value == "auto":
        return True
    if isinstance(value, dict):
        return any(has_auto(v) for v in value.values())
    return isinstance(value, list) and any(has_auto(v) for v in value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--quiet", action="store_true", help="totals only")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # the loader's warnings (unread top-level keys) would interleave
    counts: dict[Outcome, int] = {o: 0 for o in Outcome}
    reasons: dict[str, int] = {}
    without_auto = [0, 0]  # configs without any "auto", and those of them that load
    once_filled: dict[Outcome, int] = {}  # the "auto" configs, filled as the HF Trainer would
    skipped = 0
    for path in sorted(Path(args.directory).rglob("*.json")):
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            skipped += 1
            continue
        if not is_deepspeed_config(raw):
            continue
        verdict = classify(raw)
        counts[verdict.outcome] += 1
        if verdict.outcome is not Outcome.LOADS:
            reasons[f"{verdict.outcome.value}: {verdict.reason}"] = reasons.get(
                f"{verdict.outcome.value}: {verdict.reason}", 0) + 1
        if not has_auto(raw):
            without_auto[0] += 1
            without_auto[1] += verdict.outcome is Outcome.LOADS
        if verdict.outcome is Outcome.NEEDS_INTEGRATION:
            filled = classify(filled_like_hf_trainer(raw))
            once_filled[filled.outcome] = once_filled.get(filled.outcome, 0) + 1
            verdict = Verdict(verdict.outcome, f"{verdict.reason}; filled as the HF Trainer would: "
                                               f"{filled.outcome.value} {filled.reason}".rstrip())
        if not args.quiet:
            shown = f" ({verdict.reason})" if verdict.reason else ""
            print(f"{verdict.outcome.value}{shown}: {path.relative_to(args.directory)}")
    total = sum(counts.values())
    print(f"\n{total} DeepSpeed configs ({skipped} files skipped: not valid JSON)")
    for outcome in Outcome:
        print(f"  {outcome.value}: {counts[outcome]}")
    print(f"  without \"auto\": {without_auto[1]} of {without_auto[0]} load")
    if once_filled:
        print("  needing an integration, once filled as the HF Trainer would: "
              + ", ".join(f"{o.value} {n}" for o, n in once_filled.items()))
    for reason, n in sorted(reasons.items(), key=lambda item: (-item[1], item[0])):
        print(f"    {n:3d}  {reason}")
    return 1 if counts[Outcome.UNKNOWN_KEY] else 0


if __name__ == "__main__":
    sys.exit(main())
