"""Faulty and hostile clients: what each aggregation rule, the reply check and the round's bound
on what one reply can move do.

  python benchmarks/faulty_clients.py --out /tmp/faulty \
      --result benchmarks/results/faulty-clients-digits-offline-amd-cpu.json
  python benchmarks/faulty_clients.py --suite honest --out /tmp/honest \
      --result benchmarks/results/update-bound-honest-amd-cpu.json
  python benchmarks/faulty_clients.py --suite attacks --out /tmp/attacks \
      --result benchmarks/results/update-bound-attacks-amd-cpu.json

`rules` (the default): FedAvg on the embedded DIGITS (5 domains, offline) with client
`--client` replaced by a faulty one from round `--from-round` on, for every fault x rule:
`scaled` uploads its trained weights times 1e6 (finite: before the round's bound only a robust
rule resisted it), `nan` uploads NaN in one tensor, `shape` one tensor with an extra axis (the
reply check drops both). The fault is injected by wrapping the method's client half, as a
hostile node would answer.

`honest`: every registered method and composition (`--preset smoke` on digits-offline), and a
few on federations of unequal client sizes, with every client honest; records, per run, the
largest ratio of a reply's size to its round's median (an upper bound on its ratio to the
second-largest size, the reference of `fedvl.core.bounds`), the largest ratio of two honest
replies' sizes and the largest root-mean-square, and that the bound refused nothing.

`attacks`: per method, an honest run and one where client `--client` tampers with its reply in
rounds `--from-round` to `--from-round` + 1, as it reaches the server (its peer messages, for
DESA): every value of its bounded tensors 1e38, -1e38, its tensors x 1e30, its update
sign-flipped x 1e6 (as sent, for uploads that are no update), each alone and with a
`num_examples` lie (it announced 10^9 training images when it joined and claims them). Records
whether the run completed, what was refused and the final mean accuracy. Runs finished under
the same `--out` by an earlier call are read back, so an interrupted suite resumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from provenance import machine, write_result

import fedvl.engine.driver as driver_module
from fedvl.algorithms.fedavg import FedAvg
from fedvl.config import RunConfig, preset_method_args, preset_run_args
from fedvl.core import bounds
from fedvl.core.message import Message
from fedvl.engine.driver import Exchange
from fedvl.engine.inprocess import InProcessTransport
from fedvl.registry import ALGORITHMS
from fedvl.run.experiment import run_experiment

BASE = RunConfig(method="fedavg", benchmark="digits-offline", rounds=30, eval_every=10,
                 train_cap=200, test_cap=200, threads=1, seed=0,
                 model_args={"width": 16, "depth": 3, "norm": "instance"})
RULES = ("samples", "median", "trimmed-mean")
# Federations of unequal client sizes for the honest suite: each digits domain split over 3
# clients by Dirichlet(0.1) label shares (15 clients of 8 to 64 images at the smoke caps).
UNEQUAL = {"partitions": 3, "alpha": 0.1}
UNEQUAL_METHODS = ("fedavg", "scaffold", "fednova", "feddyn", "fedproto", "fedhe", "fedgen",
                   "feddf")
# The largest steps `fedvl tune` tries (lr 0.1, 5 local epochs), over 4 rounds: what honest
# training sends at its most.
STRESS = {"lr": 0.1, "local_epochs": 5, "rounds": 4}
# Clients of different architectures (ConvNet and AlexNet alternating), for the methods that
# take them: their uploads differ by architecture, not only by data.
MIXED = {"client_models": ["alternate"]}
MIXED_METHODS = ("dense", "desa", "feddf", "fedhe", "fedproto")
# Methods of the attack suite: every one whose replies (or peer messages) carry a bounded kind.
ATTACK_METHODS = ("fedavg", "fedprox", "fedavgm", "fedadam", "fednova", "scaffold", "feddyn",
                  "dynafed", "moon", "fedbn", "vhl", "fedprox+vhl", "scaffold+fedbn", "feddf",
                  "fedproto", "fedhe", "desa", "fedvck", "fedlgd", "fedgen", "fedmix", "fedaf",
                  "dense")
ATTACKS = ("1e38", "-1e38", "x1e30", "sign-flipped x1e6")
# The announced training-set size of a lying client (the bound of its `num_examples`).
LIE = 10**9
# Run settings some methods need (FedDF distils on an unlabelled public set).
RUN_EXTRA: dict[str, dict[str, Any]] = {"feddf": {"public": "digits-offline",
                                                  "public_size": 100}}


def _fault(kind: str) -> Callable[[Message], Message]:
    """The reply transformation of a faulty client (suite `rules`)."""
    def scaled(r: Message) -> Message:
        w = r.arrays["weights"]
        for k, v in w.items():
            if v.is_floating_point():
                w[k] = v * 1e6
        return r

    def nan(r: Message) -> Message:
        w = r.arrays["weights"]
        k = next(k for k, v in w.items() if v.is_floating_point())
        w[k] = torch.full_like(w[k], float("nan"))
        return r

    def shape(r: Message) -> Message:
        w = r.arrays["weights"]
        k = next(iter(w))
        w[k] = w[k].unsqueeze(0)
        return r

    return {"none": lambda r: r, "scaled": scaled, "nan": nan, "shape": shape}[kind]


def rules_suite(a: argparse.Namespace) -> dict[str, Any]:
    """Every fault x aggregation rule on FedAvg."""
    original = FedAvg.client_update
    rows = {}
    for fault in ("none", "scaled", "nan", "shape"):
        change = _fault(fault)

        def update(self, msg, ctx, change=change):
            reply = original(self, msg, ctx)
            return change(reply) if ctx.cid == a.client and ctx.round >= a.from_round else reply

        FedAvg.client_update = update  # type: ignore[method-assign]
        for rule in RULES:
            cfg = dataclasses.replace(BASE, aggregation=rule, trim=0.2)
            s = run_experiment(cfg, out=Path(a.out) / f"{fault}-{rule}")
            rows[f"{fault}/{rule}"] = {
                "mean_accuracy": s["mean_accuracy"],
                "per_client_accuracy": s["per_client_accuracy"],
                "rejected_replies": len(s["rejected_replies"]),
                "first_rejection": (s["rejected_replies"] or [{}])[0].get("reason"),
                "wall_seconds": s["wall_seconds"],
            }
            print(fault, rule, f"{s['mean_accuracy']:.4f}", len(s["rejected_replies"]))
    FedAvg.client_update = original  # type: ignore[method-assign]
    return {"config": BASE.to_dict(), "faulty_client": a.client,
            "faulty_from_round": a.from_round, "trim": 0.2, "runs": rows,
            "note": "FedAvg, embedded DIGITS offline (5 clients, 200 train / 200 test each), "
                    "ConvNet width 16, 30 rounds, 1 local epoch; one client faulty from round "
                    "2 on. CPU scale."}


def smoke_cfg(method: str, rounds: int = 2, **extra: Any) -> RunConfig:
    """`fedvl run --method METHOD --preset smoke` on digits-offline, one torch thread."""
    run = {**preset_run_args("smoke", method), "rounds": rounds, "train_cap": 100,
           "test_cap": 100}
    if getattr(ALGORITHMS.get(method), "addon_name", None) == "fedbn" or method == "fedbn":
        run["model_args"] = {"norm": "batch"}   # its local layers are the BatchNorm ones
    return RunConfig(method=method, benchmark="digits-offline", threads=1, seed=0,
                     method_args=preset_method_args("smoke", method),
                     **{**run, **RUN_EXTRA.get(method, {}), **extra})


class SizeLog:
    """Wraps the driver's `bound_round`: records every group's sizes per round, then bounds."""

    def __init__(self) -> None:
        self.original = driver_module.bound_round
        self.rounds: list[dict[str, list[float]]] = []
        self.compared: dict[str, bool] = {}   # group -> whether the median applies to it
        self.refused = 0

    def __enter__(self) -> SizeLog:
        def recording(messages, sent, measures, skip=None, **kw):
            groups: dict[str, list[float]] = {}
            for key, msg in messages.items():
                got = bounds.sizes(msg, sent.get(key), measures, (skip or {}).get(key, ()))
                for g, v in got.items():
                    groups.setdefault(g, []).append(v)
                    m = measures.get(g.partition("/")[0])
                    self.compared[g] = m is None or m.relative
            if groups:
                self.rounds.append(groups)
            out = self.original(messages, sent, measures, skip, **kw)
            self.refused += len(out)
            return out

        driver_module.bound_round = recording
        return self

    def __exit__(self, *exc: object) -> None:
        driver_module.bound_round = self.original

    def summary(self) -> dict[str, Any]:
        """The largest ratio to the median, of two honest sizes, and the largest size (groups
        the median does not apply to: their largest ratio of two sizes apart)."""
        best: dict[str, Any] = {"ratio_to_median": 0.0, "ratio_to_median_group": None,
                                "largest_over_smallest": 0.0, "largest_over_smallest_group": None,
                                "largest_rms": 0.0, "largest_rms_group": None,
                                "groups_compared": 0, "not_compared_largest_over_smallest": 0.0}
        for groups in self.rounds:
            for g, values in groups.items():
                if max(values) > best["largest_rms"]:
                    best["largest_rms"], best["largest_rms_group"] = max(values), g
                if len(values) < bounds.MIN_REPLIES or min(values) <= 0:
                    continue
                if not self.compared[g]:
                    best["not_compared_largest_over_smallest"] = max(
                        best["not_compared_largest_over_smallest"], max(values) / min(values))
                    continue
                best["groups_compared"] += 1
                med = statistics.median(values)
                if max(values) / med > best["ratio_to_median"]:
                    best["ratio_to_median"], best["ratio_to_median_group"] = max(values) / med, g
                if max(values) / min(values) > best["largest_over_smallest"]:
                    best["largest_over_smallest"] = max(values) / min(values)
                    best["largest_over_smallest_group"] = g
        return {**best, "refused": self.refused}


def honest_suite(a: argparse.Namespace) -> dict[str, Any]:
    """Every method's smoke run (and a few on unequal client sizes): the sizes the bound saw."""
    matrix = [n for n in ALGORITHMS.names() if "+" not in n]
    covered = {getattr(ALGORITHMS.get(n), "addon_name", None) for n in matrix}
    from fedvl.registry import ADDONS
    matrix += [f"fedavg+{x}" for x in ADDONS.names()
               if x not in covered and f"fedavg+{x}" in ALGORITHMS]
    matrix += [n for n in ALGORITHMS.names() if "+" in n and n not in matrix]
    runs: dict[str, Any] = {}
    todo = [(m, "smoke", {}) for m in (a.methods or matrix)]
    todo += [(m, "unequal", UNEQUAL) for m in (a.methods or UNEQUAL_METHODS)]
    todo += [(m, "stress", STRESS) for m in (a.methods or UNEQUAL_METHODS)]
    todo += [(m, "mixed", MIXED) for m in (a.methods or MIXED_METHODS)]
    for method, setting, extra in todo:
        if a.settings and setting not in a.settings:
            continue
        t0 = time.perf_counter()
        with SizeLog() as log:
            s = run_experiment(smoke_cfg(method, **{"rounds": a.rounds, **extra}),
                               out=Path(a.out) / f"{setting}-{method}")
        row = {**log.summary(), "rejected_replies": len(s["rejected_replies"]),
               "mean_accuracy": s.get("mean_accuracy"),
               "seconds": round(time.perf_counter() - t0, 1)}
        runs[f"{setting}/{method}"] = row
        print(setting, method, f"ratio {row['ratio_to_median']:.3g}",
              f"max/min {row['largest_over_smallest']:.3g}", f"rms {row['largest_rms']:.3g}",
              f"refused {row['refused']}", flush=True)

    def top(key: str) -> dict[str, Any]:
        name, row = max(runs.items(), key=lambda kv: kv[1][key])
        return {"value": row[key], "run": name, "group": row[f"{key}_group"]}

    return {"setting": f"digits-offline --preset smoke --rounds {a.rounds} --threads 1 (smoke); "
                       f"the same with --partitions {UNEQUAL['partitions']} --alpha "
                       f"{UNEQUAL['alpha']} (unequal); with --lr {STRESS['lr']} "
                       f"--local-epochs {STRESS['local_epochs']} --rounds {STRESS['rounds']} "
                       f"(stress); with --client-models alternate (mixed)",
            "relative_bound": bounds.RELATIVE_BOUND, "absolute_bound": bounds.ABSOLUTE_BOUND,
            "largest": {k: top(k) for k in ("ratio_to_median", "largest_over_smallest",
                                            "largest_rms")},
            "refused_in_total": sum(r["refused"] for r in runs.values()),
            "runs": runs}


def tamper(attack: str, reply: Message, sent: Message | None, measures: dict,
           counts: frozenset[str], lie: bool) -> Message:
    """`reply` as a hostile client sends it: `attack` on every floating tensor of its bounded
    kinds (counts aside: they are checked as counts), `num_examples` LIE with `lie`."""
    arrays = {k: dict(v) for k, v in reply.arrays.items()}
    for kind, tensors in arrays.items():
        m = measures.get(kind)
        if m is None:
            continue
        ref = {} if sent is None or m.against is None else sent.arrays.get(m.against, {})
        for name, t in tensors.items():
            if not t.is_floating_point() or f"{kind}/{name}" in counts:
                continue
            if attack in ("1e38", "-1e38"):
                tensors[name] = torch.full_like(t, float(attack))
            elif attack == "x1e30":
                tensors[name] = t * 1e30
            else:
                r = ref.get(name)
                r = r.to(t.device) if r is not None and r.shape == t.shape else None
                tensors[name] = -1e6 * t if r is None else r - 1e6 * (t - r)
    meta = dict(reply.meta)
    if lie and "num_examples" in meta:
        meta["num_examples"] = LIE
    return Message(arrays, meta)


def attacked_run(method: str, attack: str | None, lie: bool, a: argparse.Namespace,
                 out: Path) -> dict[str, Any]:
    """One run of the attack suite (attack None: honest); what happened. A run that finished
    in an earlier call with the same `--out` (its summary.json there) is read, not re-run."""
    done = out / "summary.json"
    if done.exists():
        s = json.loads(done.read_text())
        return {"status": "completed", "mean_accuracy": s.get("mean_accuracy"),
                "rejected": [{k: r[k] for k in ("round", "client", "reason")}
                             for r in s["rejected_replies"]],
                "tampering_client": list(s["per_client_accuracy"])[a.client]}
    alg_cls = ALGORITHMS.get(method)
    measures, counts = dict(alg_cls.bounded_kinds), alg_cls.count_tensors
    hit = range(a.from_round, a.from_round + 2)
    exchange, share, size = (InProcessTransport.exchange, InProcessTransport.share,
                             InProcessTransport.train_size)
    names: list[str] = []

    def tampered_exchange(self, rnd, outgoing, inboxes=None) -> Exchange:
        names[:] = [self.names[a.client]]
        ex = exchange(self, rnd, outgoing, inboxes)
        if attack and rnd in hit and a.client in ex.replies:
            ex.replies[a.client] = tamper(attack, ex.replies[a.client], outgoing[a.client],
                                          measures, counts, lie)
        return ex

    def tampered_share(self, rnd, peers):
        sent = share(self, rnd, peers)
        if attack and rnd in hit and a.client in sent:
            sent[a.client] = {r: tamper(attack, m, None, measures, counts, lie)
                              for r, m in sent[a.client].items()}
        return sent

    def announced(self, cid):
        return LIE if lie and cid == a.client else size(self, cid)

    InProcessTransport.exchange = tampered_exchange  # type: ignore[method-assign]
    InProcessTransport.share = tampered_share  # type: ignore[method-assign]
    InProcessTransport.train_size = announced  # type: ignore[method-assign]
    if a.setting == "default":   # `fedvl run --method METHOD` as it comes, one torch thread
        cfg = RunConfig(method=method, benchmark="digits-offline", threads=1, seed=0,
                        **RUN_EXTRA.get(method, {}))
    else:
        cfg = smoke_cfg(method, rounds=a.rounds, eval_every=a.rounds)
    try:
        s = run_experiment(cfg, out=out)
        status, acc = "completed", s.get("mean_accuracy")
        rejected = [{"round": r["round"], "client": r["client"], "reason": r["reason"]}
                    for r in s["rejected_replies"]]
    except Exception as e:   # noqa: BLE001 - a stopped run is a result here
        status, acc, rejected = f"stopped: {type(e).__name__}: {e}"[:300], None, []
    finally:
        InProcessTransport.exchange = exchange  # type: ignore[method-assign]
        InProcessTransport.share = share  # type: ignore[method-assign]
        InProcessTransport.train_size = size  # type: ignore[method-assign]
    return {"status": status, "mean_accuracy": acc, "rejected": rejected,
            "tampering_client": names[0] if names else None}


def attacks_suite(a: argparse.Namespace) -> dict[str, Any]:
    """Per method: the honest run, then every attack alone and with a `num_examples` lie."""
    runs: dict[str, Any] = {}
    for method in a.methods or ATTACK_METHODS:
        t0 = time.perf_counter()
        honest = attacked_run(method, None, False, a, Path(a.out) / method / "honest")
        cases = {}
        for attack in ATTACKS:
            for lie in (False, True):
                name = f"{attack}{' + num_examples lie' if lie else ''}"
                cases[name] = attacked_run(method, attack, lie, a,
                                           Path(a.out) / method / name.replace(" ", "_"))
        accs = [c["mean_accuracy"] for c in cases.values() if c["mean_accuracy"] is not None]
        hit_rounds = {a.from_round, a.from_round + 1}
        runs[method] = {
            "honest": honest,
            "cases": cases,
            "stopped": sum(c["status"] != "completed" for c in cases.values()),
            "refused_every_tampered_reply": all(
                {r["round"] for r in c["rejected"] if r["client"] == c["tampering_client"]
                 or r["client"].startswith(f"{c['tampering_client']}->")} >= hit_rounds
                for c in cases.values()),
            "refused_honest_replies": sum(
                1 for c in cases.values() for r in c["rejected"]
                if r["client"] != c["tampering_client"]
                and not r["client"].startswith(f"{c['tampering_client']}->")),
            "largest_accuracy_drop": (None if honest["mean_accuracy"] is None or not accs
                                      else honest["mean_accuracy"] - min(accs)),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(method, honest["status"], honest["mean_accuracy"],
              {k: (c["status"][:9], c["mean_accuracy"]) for k, c in cases.items()}, flush=True)
    setting = ("digits-offline with the default settings (`fedvl run --method METHOD "
               "--threads 1`: 20 rounds, 600 training images per client)"
               if a.setting == "default" else
               f"digits-offline, --preset smoke's caps (100 training and test images per "
               f"client) and method options, {a.rounds} rounds")
    return {"setting": f"{setting}, 5 clients (all every round), seed 0, one torch thread; "
                       f"client {a.client} tampers in rounds {a.from_round} and "
                       f"{a.from_round + 1}",
            "relative_bound": bounds.RELATIVE_BOUND, "absolute_bound": bounds.ABSOLUTE_BOUND,
            "attacks": list(ATTACKS), "announced_by_the_liar": LIE,
            "cases_tried": sum(len(r["cases"]) for r in runs.values()),
            "runs_stopped": sum(r["stopped"] for r in runs.values()),
            "runs": runs}


def main() -> None:
    """Run one suite and write its results file."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=("rules", "honest", "attacks"), default="rules")
    p.add_argument("--out", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--client", type=int, default=1)
    p.add_argument("--from-round", type=int, default=None,
                   help="first faulty round (rules: 2; attacks: 1)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of the honest (2) and attacks (20) suites")
    p.add_argument("--methods", nargs="*", default=None,
                   help="the honest and attacks suites' methods (default: all of theirs)")
    p.add_argument("--setting", choices=("smoke", "default"), default="smoke",
                   help="the attacks suite's runs: smoke-sized, or `fedvl run`'s defaults")
    p.add_argument("--settings", nargs="*", default=None,
                   choices=("smoke", "unequal", "stress", "mixed"),
                   help="the honest suite's settings (default: all)")
    a = p.parse_args()
    if a.from_round is None:
        a.from_round = 2 if a.suite == "rules" else 1
    if a.rounds is None:
        a.rounds = 2 if a.suite == "honest" else 20
    fields = {"rules": rules_suite, "honest": honest_suite, "attacks": attacks_suite}[a.suite](a)
    write_result(a.result, machine("CPU only"), fields)
    print(f"written: {a.result}")


if __name__ == "__main__":
    main()
