"""Expert load imbalance (MaxVio) and an expert-parallel placement what-if, replayed over recorded routing.

Torch-free: polars frames in, polars frames out (and one aggregate SQL over a store's ``routing`` table for a
batch). ``Run.maxvio``, ``Batch.maxvio``, ``Batch.placement`` and ``Batch.placement_summary`` are thin wrappers.

**Load.** The load of expert ``e`` in MoE layer ``l`` is the number of routed slots (rows of ``routing``: one per
position x layer x chosen expert, prompt and generated positions alike) that chose ``e``.

**MaxVio** (DeepSeek, arXiv 2408.15664): per layer ``MaxVio = max_e load_e / mean_e load_e - 1``, the mean over
all ``E`` routed experts of the model (an expert never chosen counts as load 0). 0 is perfect balance; with
top-k routing over ``T`` tokens the largest possible value is ``E / k - 1`` (every token on the same k experts).
``maxvio`` is the global value over all the tokens (of the run or the batch); the chunked variants cut the token
stream into consecutive chunks of ``chunk`` tokens (positions of a run in order; a batch's runs one after the
other in their order of recording) and give the mean (``maxvio_chunk_mean``: the paper's per-step variant) and
the max (``maxvio_chunk_max``) over the chunks. The trailing partial chunk is left out when at least one full
chunk exists (a chunk of 3 tokens is imbalanced by construction); a stream shorter than one chunk is one chunk.
``chunks`` says how many chunks were used. Default ``chunk``: ``MAXVIO_CHUNK`` = 256 tokens.

**Placement what-if.** ``G`` devices (``devices``) and ``R`` redundant expert slots (``redundant``): ``E + R``
physical expert slots in all, ``(E + R) / G`` per device (``G`` must divide ``E + R``). Policies:

- ``contiguous``: expert ``e`` on device ``e // ((E + R) / G)``; with ``R = 0`` that is ``e // (E / G)`` (the
  seeds' 4 experts per card). With ``R > 0`` the replicas chosen as EPLB chooses them (below) take the physical
  slots ``E .. E + R - 1`` in order, so they land on the last devices: replication without balancing.
- ``eplb`` (DeepSeek EPLB's global policy, our own code): replication, then balanced packing, per layer.
  Replication: ``R`` times, add one replica to the expert whose load per replica ``load_e / replicas_e`` is the
  largest (ties: the lower expert id). Packing: the ``E + R`` replicas, each weighing ``load_e / replicas_e``,
  heaviest first (ties: the lower expert id), each onto the least loaded device (ties: the lower device id) of
  those holding fewer than ``(E + R) / G`` replicas. Two replicas of one expert may share a device (EPLB does not
  forbid it either); that helps neither load nor traffic.
- a user's placement: a dict or a JSON file ``{layer or "*": [[experts on device 0], [on device 1], ...]}`` (a
  layer's own key wins over ``"*"``). Every expert must appear at least once per layer; an expert listed ``n``
  times has ``n`` replicas. ``G`` is the number of lists; slot counts may differ between devices.

Every replica of an expert takes an equal share of its tokens: device ``d`` processes
``slots_d = sum over the replicas on d of load_e / replicas_e`` (a float). Per policy and layer the summary gives
``max_load`` and ``mean_load = total / G`` of ``slots_d`` and their ratio ``imbalance``.

**All-to-all traffic.** Tokens are spread evenly over the ``G`` devices as their source (the device that holds
the token's hidden state: data parallel attention). A routed slot stays on its source device when its expert
has a replica there (a token is sent to a local replica when there is one), else it is sent to another device.
So, with ``D_e`` the number of distinct devices holding a replica of ``e``::

    offdevice_slots = sum_e load_e * (1 - D_e / G)          offdevice_share = offdevice_slots / sum_e load_e

(With local replicas preferred and the remaining tokens shared evenly, each replica on distinct devices gets
``load_e / G + load_e (1 - D_e / G) / D_e = load_e / D_e`` tokens: the equal share above.) It counts routed
slots (token x expert pairs), not tokens deduplicated per destination device.
"""
from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from workbench.data.store import Store

MAXVIO_CHUNK = 256
POLICIES = ("contiguous", "eplb")
MAXVIO_SCHEMA = {"layer": pl.Int64, "maxvio": pl.Float64, "maxvio_chunk_mean": pl.Float64,
                 "maxvio_chunk_max": pl.Float64, "chunks": pl.Int64, "slots": pl.Int64}
PLACEMENT_SCHEMA = {"policy": pl.Utf8, "layer": pl.Int64, "device": pl.Int64, "slots": pl.Float64,
                    "replicas": pl.Int64, "experts": pl.List(pl.Int64)}
SUMMARY_SCHEMA = {"policy": pl.Utf8, "layer": pl.Int64, "devices": pl.Int64, "redundant": pl.Int64,
                  "slots": pl.Float64, "max_load": pl.Float64, "mean_load": pl.Float64, "imbalance": pl.Float64,
                  "offdevice_slots": pl.Float64, "offdevice_share": pl.Float64}


# -- loads --------------------------------------------------------------------------------------------

def _check_chunk(chunk: int) -> int:
    if int(chunk) < 1:
        raise ValueError(f"chunk must be >= 1 tokens, got {chunk}")
    return int(chunk)


def routing_loads(routing: pl.DataFrame, chunk: int = MAXVIO_CHUNK) -> pl.DataFrame:
    """``chunk, layer, expert, slots`` from routing rows (``pos, layer, expert``; with ``run_id``, the runs in
    their order of first appearance), the tokens numbered in stream order and cut into chunks of ``chunk``."""
    chunk = _check_chunk(chunk)
    if routing.height == 0:
        return pl.DataFrame(schema={"chunk": pl.Int64, "layer": pl.Int64, "expert": pl.Int64, "slots": pl.Int64})
    rt = routing if "run_id" in routing.columns else routing.with_columns(pl.lit("").alias("run_id"))
    order = rt.select("run_id").unique(maintain_order=True).with_row_index("run_order")
    toks = (rt.select("run_id", "pos").unique().join(order, on="run_id").sort("run_order", "pos")
            .with_row_index("tok").with_columns((pl.col("tok").cast(pl.Int64) // chunk).alias("chunk"))
            .select("run_id", "pos", "chunk"))
    return (rt.join(toks, on=["run_id", "pos"]).group_by("chunk", "layer", "expert")
            .agg(pl.len().cast(pl.Int64).alias("slots"))
            .with_columns(pl.col("chunk", "layer", "expert").cast(pl.Int64)).sort("chunk", "layer", "expert"))


def store_loads(store: Store, run_ids: list[str], chunk: int = MAXVIO_CHUNK) -> pl.DataFrame:
    """``routing_loads`` of several runs, aggregated in the store (one SQL; runs in the order of ``run_ids``)."""
    chunk = _check_chunk(chunk)
    if not run_ids:
        return routing_loads(pl.DataFrame(), chunk)
    df = store.sql("""
        WITH ids AS (SELECT unnest($ids) AS run_id, generate_subscripts($ids, 1) AS run_order),
             r AS (SELECT routing.run_id, pos, layer, expert, run_order FROM routing JOIN ids USING (run_id)),
             tok AS (SELECT run_id, pos,
                            (row_number() OVER (ORDER BY run_order, pos) - 1) // $n AS chunk
                     FROM (SELECT DISTINCT run_id, run_order, pos FROM r))
        SELECT chunk, layer, expert, count(*) AS slots FROM r JOIN tok USING (run_id, pos)
        GROUP BY chunk, layer, expert ORDER BY chunk, layer, expert""", {"ids": list(run_ids), "n": chunk})
    return df.with_columns(pl.col("chunk", "layer", "expert", "slots").cast(pl.Int64))


def layer_loads(loads: pl.DataFrame, n_experts: int) -> dict[int, list[int]]:
    """Per layer, the load of every expert 0..E-1 summed over the chunks."""
    out: dict[int, list[int]] = {}
    for (layer,), grp in loads.group_by("layer", maintain_order=True):
        v = [0] * n_experts
        for e, s in zip(grp["expert"].to_list(), grp["slots"].to_list()):
            if not 0 <= e < n_experts:
                raise ValueError(f"expert {e} in layer {layer} is outside 0..{n_experts - 1}")
            v[e] += int(s)
        out[int(layer)] = v
    return dict(sorted(out.items()))


# -- MaxVio ---------------------------------------------------------------------------------------------

def maxvio(loads: pl.DataFrame, n_experts: int) -> pl.DataFrame:
    """``layer, maxvio, maxvio_chunk_mean, maxvio_chunk_max, chunks, slots`` from ``chunk, layer, expert, slots``
    (``routing_loads`` / ``store_loads``): see the module doc. An expert's load is 0 where it has no row, so the
    max over all E experts is the max over the rows, and the mean is the layer's slots / E."""
    if n_experts < 1:
        raise ValueError("MaxVio needs a model with routed experts")
    if loads.height == 0:
        return pl.DataFrame(schema=MAXVIO_SCHEMA)
    if loads["expert"].max() >= n_experts or loads["expert"].min() < 0:
        raise ValueError(f"routing names experts outside 0..{n_experts - 1}")
    vio = (pl.col("top") * n_experts / pl.col("total") - 1.0)
    glob = (loads.group_by("layer", "expert").agg(pl.col("slots").sum())
            .group_by("layer").agg(pl.col("slots").max().alias("top"), pl.col("slots").sum().alias("total"))
            .select("layer", vio.alias("maxvio"), pl.col("total").cast(pl.Int64).alias("slots")))
    per = (loads.group_by("layer", "chunk")
           .agg(pl.col("slots").max().alias("top"), pl.col("slots").sum().alias("total")).sort("layer", "chunk"))
    last = per.group_by("layer").agg(pl.col("chunk").max().alias("last"), pl.col("total").max().alias("full"),
                                     pl.len().alias("n"))
    per = (per.join(last, on="layer")  # the trailing partial chunk is left out when a full one exists
           .filter(~((pl.col("chunk") == pl.col("last")) & (pl.col("total") < pl.col("full")) & (pl.col("n") > 1))))
    chunked = per.group_by("layer").agg(vio.mean().alias("maxvio_chunk_mean"), vio.max().alias("maxvio_chunk_max"),
                                        pl.len().cast(pl.Int64).alias("chunks"))
    return (glob.join(chunked, on="layer").with_columns(pl.col("layer").cast(pl.Int64))
            .select(list(MAXVIO_SCHEMA)).cast(MAXVIO_SCHEMA).sort("layer"))


# -- placement layouts -----------------------------------------------------------------------------------

def check_layout(devices: int, redundant: int, n_experts: int) -> int:
    """Physical expert slots per device; ValueError (one line) unless ``devices`` divides ``E + redundant``."""
    if int(redundant) < 0:
        raise ValueError(f"--redundant must be >= 0, got {redundant}")
    if int(devices) < 1:
        raise ValueError(f"--devices must be >= 1, got {devices}")
    total = n_experts + int(redundant)
    if total % int(devices):
        raise ValueError(f"--devices {devices} must divide experts + redundant = {n_experts} + {redundant} = {total}")
    return total // int(devices)


def replicate(load: list[float], redundant: int) -> list[int]:
    """Replicas per expert: 1 each, then ``redundant`` more, each to the largest load per replica (lower id on ties)."""
    reps = [1] * len(load)
    for _ in range(int(redundant)):
        best = max(range(len(load)), key=lambda e: (load[e] / reps[e], -e))
        reps[best] += 1
    return reps


def contiguous_layout(load: list[float], devices: int, redundant: int = 0) -> list[list[int]]:
    """Expert ``e`` on device ``e // per``; the replicas (``replicate``) in the last physical slots."""
    per = check_layout(devices, redundant, len(load))
    reps = replicate(load, redundant)
    physical = list(range(len(load))) + [e for e in range(len(load)) for _ in range(reps[e] - 1)]
    return [physical[d * per:(d + 1) * per] for d in range(int(devices))]


def eplb_layout(load: list[float], devices: int, redundant: int = 0) -> list[list[int]]:
    """DeepSeek EPLB's replication and balanced packing (module doc)."""
    per = check_layout(devices, redundant, len(load))
    reps = replicate(load, redundant)
    items = sorted(((load[e] / reps[e], e) for e in range(len(load)) for _ in range(reps[e])),
                   key=lambda t: (-t[0], t[1]))
    weight, held = [0.0] * int(devices), [[] for _ in range(int(devices))]
    for w, e in items:
        d = min((d for d in range(int(devices)) if len(held[d]) < per), key=lambda d: (weight[d], d))
        held[d].append(e)
        weight[d] += w
    return [sorted(h) for h in held]


def read_placement(spec: dict | str | Path) -> dict:
    """A user's placement: the dict itself, or the JSON file it is in."""
    if isinstance(spec, dict):
        return spec
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"no placement file {path} (a policy is contiguous, eplb or a JSON file)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a placement is a JSON object {{layer or \"*\": [[experts of device 0], ...]}}")
    return data


def _user_layout(spec: dict, layer: int, n_experts: int, devices: int | None) -> list[list[int]]:
    got = spec.get(str(layer), spec.get(layer, spec.get("*")))
    if got is None:
        raise ValueError(f"the placement names no layer {layer} (and no \"*\")")
    if not isinstance(got, list) or not got or not all(isinstance(d, list) for d in got):
        raise ValueError(f"layer {layer}: a placement is a list of lists of experts, one list per device")
    if devices is not None and len(got) != int(devices):
        raise ValueError(f"layer {layer}: the placement has {len(got)} devices, --devices says {devices}")
    flat = [e for d in got for e in d]
    if any(not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < n_experts for e in flat):
        raise ValueError(f"layer {layer}: experts must be integers 0..{n_experts - 1}")
    missing = sorted(set(range(n_experts)) - set(flat))
    if missing:
        raise ValueError(f"layer {layer}: experts {missing[:8]} are on no device")
    return [sorted(d) for d in got]


def policy_name(policy) -> str:
    if isinstance(policy, dict):
        return "custom"
    if str(policy) in POLICIES:
        return str(policy)
    return Path(policy).name


def layouts(loads: dict[int, list[int]], devices: int | None, redundant: int, policy) -> dict[int, list[list[int]]]:
    """Per layer, the experts (one entry per replica) on each device."""
    if isinstance(policy, str) and policy in POLICIES:
        if devices is None:
            raise ValueError(f"policy {policy} needs --devices")
        fn = contiguous_layout if policy == "contiguous" else eplb_layout
        return {layer: fn([float(x) for x in v], devices, redundant) for layer, v in loads.items()}
    if isinstance(policy, str) and not policy.endswith(".json") and not Path(policy).exists():
        raise ValueError(f"unknown policy {policy!r}: contiguous, eplb or a placement JSON file")
    if int(redundant):
        raise ValueError("a JSON placement sets its own replicas (an expert listed n times); drop --redundant")
    spec = read_placement(policy)
    return {layer: _user_layout(spec, layer, len(v), devices) for layer, v in loads.items()}


def placement(loads: dict[int, list[int]], devices: int | None, redundant: int = 0,
              policy="contiguous") -> pl.DataFrame:
    """``policy, layer, device, slots, replicas, experts``: the routed slots each device processes."""
    name, rows = policy_name(policy), []
    for layer, held in layouts(loads, devices, redundant, policy).items():
        load = loads[layer]
        reps = [0] * len(load)
        for d in held:
            for e in d:
                reps[e] += 1
        for dev, exps in enumerate(held):
            rows.append({"policy": name, "layer": layer, "device": dev,
                         "slots": float(sum(load[e] / reps[e] for e in exps)), "replicas": len(exps),
                         "experts": list(exps)})
    return pl.DataFrame(rows, schema=PLACEMENT_SCHEMA)


def summary(per_device: pl.DataFrame, loads: dict[int, list[int]], redundant: int = 0) -> pl.DataFrame:
    """Per policy and layer of a ``placement`` frame: max / mean device load and the all-to-all traffic."""
    rows = []
    for (name, layer), grp in per_device.group_by("policy", "layer", maintain_order=True):
        load, g = loads[int(layer)], grp.height
        spread = [0] * len(load)
        for exps in grp["experts"].to_list():
            for e in set(exps):
                spread[e] += 1
        total = float(sum(load))
        off = float(sum(x * (1 - spread[e] / g) for e, x in enumerate(load)))
        mean = total / g
        rows.append({"policy": name, "layer": int(layer), "devices": g, "redundant": int(redundant),
                     "slots": total, "max_load": float(grp["slots"].max()), "mean_load": mean,
                     "imbalance": float(grp["slots"].max()) / mean if mean else None,
                     "offdevice_slots": off, "offdevice_share": off / total if total else None})
    return pl.DataFrame(rows, schema=SUMMARY_SCHEMA)


def to_json(per_device: pl.DataFrame) -> dict:
    """A ``placement`` frame (one policy) as a user placement ``{layer: [[experts of device 0], ...]}``."""
    out: dict[str, list] = {}
    for (layer,), grp in per_device.sort("layer", "device").group_by("layer", maintain_order=True):
        out[str(int(layer))] = [list(x) for x in grp["experts"].to_list()]
    return out
