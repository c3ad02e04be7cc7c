"""Speed: batched DM step (fedvl.distill) vs a straightforward per-class loop (reference style).

Both use the same frozen random ConvNet, the same real/synthetic batches and the same DSA draw
(one parameter set per class), and must give the same loss. Steps are interleaved (batched,
loop, batched, ...) so both see the same background load on the shared machine.

    python benchmarks/distill_speed.py --widths 32,128 --batch-real 256 --ipc 10 --steps 10
    python benchmarks/distill_speed.py --device cuda --out benchmarks/results/distill-speed-gpu.json

On a GPU every timed step ends with a synchronisation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from provenance import command, machine, write_result

from fedvl.distill.augment import DSAConfig, apply_dsa, sample_dsa_params
from fedvl.distill.losses import mean_embedding_loss
from fedvl.distill.synthesize import embed_real_and_syn
from fedvl.models.base import build_model

CHUNK = 128


def batched_step(model, xr, yr, syn, ys, params, k):
    """One DM loss+gradient as `DistributionMatching` takes it: augment, embed, class means."""
    with torch.no_grad():
        ar = apply_dsa(xr, params, yr)
    as_ = apply_dsa(syn, params, ys)
    zr, zs, _, _ = embed_real_and_syn(model, ar, as_, chunk=CHUNK)
    loss = mean_embedding_loss(zr, yr, zs, ys, k)
    (g,) = torch.autograd.grad(loss, syn)
    return loss.detach(), g


def loop_step(model, xr, yr, syn, ys, params, k):
    """The reference structure: per class, augment real and synthetic, embed, accumulate."""
    loss = syn.new_zeros(())
    for c in range(k):
        pc = params.select(torch.tensor([c]))
        r = apply_dsa(xr[yr == c], pc)
        s = apply_dsa(syn[ys == c], pc)
        er = model.embed(r).detach()
        es = model.embed(s)
        loss = loss + ((er.mean(0) - es.mean(0)) ** 2).sum()
    (g,) = torch.autograd.grad(loss, syn)
    return loss.detach(), g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="32,128")
    ap.add_argument("--batch-real", type=int, default=256)
    ap.add_argument("--ipc", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--out", default="benchmarks/results/distill-speed.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    global CHUNK
    CHUNK = a.chunk
    k, hw = 10, a.image_size
    g = torch.Generator().manual_seed(0)
    rows = []
    for width in [int(w) for w in a.widths.split(",")]:
        model = build_model("convnet", 3, k, hw, seed=1, width=width).to(dev)
        for p in model.parameters():
            p.requires_grad_(False)
        xr = torch.randn(k * a.batch_real, 3, hw, hw, generator=g).to(dev)
        yr = torch.arange(k).repeat_interleave(a.batch_real).to(dev)
        syn = torch.randn(k * a.ipc, 3, hw, hw, generator=g).to(dev).requires_grad_(True)
        ys = torch.arange(k).repeat_interleave(a.ipc).to(dev)
        tb, tl, diffs = [], [], []
        for step in range(a.steps + 1):  # step 0 is warm-up
            params = sample_dsa_params(k, g, DSAConfig(), hw)
            sync()
            t0 = time.perf_counter()
            lb, gb = batched_step(model, xr, yr, syn, ys, params, k)
            sync()
            t1 = time.perf_counter()
            ll, gl = loop_step(model, xr, yr, syn, ys, params, k)
            sync()
            t2 = time.perf_counter()
            rel = float((lb - ll).abs() / ll.abs().clamp_min(1e-12))
            grel = float((gb - gl).norm() / gl.norm().clamp_min(1e-12))
            diffs.append(max(rel, grel))
            if step:
                tb.append(t1 - t0)
                tl.append(t2 - t1)
        row = {"width": width, "batch_real_per_class": a.batch_real, "ipc": a.ipc,
               "real_forward_chunk": a.chunk, "steps_timed": a.steps,
               "batched_steps_per_s": 1 / statistics.median(tb),
               "loop_steps_per_s": 1 / statistics.median(tl),
               "speedup_median": statistics.median(tl) / statistics.median(tb),
               "speedup_total": sum(tl) / sum(tb),
               "max_rel_diff_loss_or_grad": max(diffs)}
        print(row, flush=True)
        rows.append(row)
    out = Path(a.out)
    doc = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    # The header is this invocation's: write_result writes it anew.
    for key in ("command", "date", "machine", "load_average_at_end"):
        doc.pop(key, None)
    where = (f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}"
             if dev.type == "cuda" else machine(f"{a.threads} thread(s)"))
    # The file gathers the runs of several invocations, each with its own command line.
    doc["runs"].append({
        "command": command(), "date": time.strftime("%Y-%m-%d"), "machine": where,
        "image": f"3x{hw}x{hw}, 10 classes, DSA color_crop_cutout_flip_scale_rotate mode S",
        "results": rows})
    write_result(out, where, doc)


if __name__ == "__main__":
    main()
