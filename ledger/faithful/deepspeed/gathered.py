"""DeepSpeed 0.19.8 ZeRO-3's gathered parameter memory at moments of a pass, for the peak (peak.py):
the storages partition_parameters.py's all-gather handles make and free (_all_gather_sequential,
_all_gather_dtype, AllGatherCoalescedHandle.wait, free_param), walked over the coordinator replay's
watched events (coordinator.pass_logs), by the probe's category of each storage.
"""
from __future__ import annotations

from functools import lru_cache
from itertools import islice
from typing import NamedTuple

from ledger.faithful.deepspeed.coordinator import pass_logs
from ledger.faithful.deepspeed.trace import Z3Trace, modules_per_block, z3_trace
from ledger.model import ModelShape
from ledger.units import ceil_div


class Z3Live(NamedTuple):
    """ZeRO-3's gathered parameter memory at one moment of a pass, by the probe's category of each
    storage (probes/peak.py: a storage's category holds for the whole step): bytes of the params' own
    storages that a forward mm saves (`saved`: the Linear weights), of the collective's outputs no op
    saves (`gathered`: coalesced calls' flat buffers, single-param buffers) and of the torch.cat copies
    no op saves (`temporary`)."""
    saved: int
    gathered: int
    temporary: int

    @property
    def total(self) -> int:
        return self.saved + self.gathered + self.temporary


def _z3_walk(model: ModelShape, tr: Z3Trace, log: list, dp: int, w: int, ats: tuple[int, ...],
             ac: bool = False) -> tuple[Z3Live, ...]:
    """Live gathered memory after each event of `ats` (indices into a watched pass's events,
    coordinator._Z3Sim.run(watch=): a fetch with its prefetch, or a release), from partition_parameters.py's
    all-gather handles:

    - one param (_all_gather_sequential): param.data is a view of its buffer of ceil(n/dp)*dp elements,
      live from the call to the param's release (free_param);
    - several (_all_gather_dtype): one flat buffer of sum(ceil(n/dp))*dp elements; the first wait() on
      the handle (AllGatherCoalescedHandle.wait; fetch_sub_module pops a module's own params off
      __inflight_param_registry and waits, before it issues the prefetch) makes every param of the call
      its own storage, torch.cat of its parts (n elements, freed at its release); the flat buffer lives
      while the registry holds the handle: until the last of its params is popped.

    A param's storage is `saved` when a forward op saves it: a Linear's weight (mm; every 2-D param but
    the embedding's own lookup, F.embedding saving the indices) and an RMSNorm's weight (the mul by it),
    looking past a forward moment up to the forward's end; a storage gathered in the backward is never
    saved. (The norms' weights are persistent under the default threshold, gathered here only in step
    0's passes.) ac: a checkpointed block's forward runs under no_grad (saving nothing) and its
    recompute, inside the backward, saves: a block module's storage is saved at its recompute's fetch,
    the modules outside the blocks' at their forward fetch."""
    M = modules_per_block(tr)
    in_block = range(2, 2 + tr.layers * M).__contains__
    two_d = [len(sh) == 2 or n.endswith("norm.weight") for n, sh in model.params()]
    emb = 1  # module 1: tok_embeddings (z3_trace)
    handle_of: dict[int, int] = {}  # in flight in a coalesced call: param -> handle id
    handles: dict[int, list] = {}  # id -> [flat bytes, its params, params not popped yet]
    storage: dict[int, tuple[int, int, str]] = {}  # param -> (serial, bytes, "gathered" | "temporary")
    saved: set[int] = set()  # serials a forward mm saves
    serial = 0
    snaps: dict[int, tuple[dict, int]] = {}
    forward = True
    for i, ev in enumerate(log):
        kind, mo = ev[0], ev[1]
        if kind == "B":
            forward = False
            if len(snaps) == len(ats):
                break
        if kind == "F" or kind == "B":
            for k, ps in enumerate((ev[2], ev[3])):  # the own fetch, then (after the wait loop) the prefetch
                if len(ps) == 1:
                    serial += 1
                    storage[ps[0]] = (serial, w * ceil_div(tr.numel[ps[0]], dp) * dp, "gathered")
                elif ps:
                    serial += 1
                    handles[serial] = [w * sum(ceil_div(tr.numel[p], dp) for p in ps) * dp, ps, set(ps)]
                    for p in ps:
                        handle_of[p] = serial
                if k == 1:
                    break
                for p in tr.mod_params[mo]:  # the wait loop
                    h = handle_of.pop(p, None)
                    if h is None:
                        continue
                    hd = handles[h]
                    if len(hd[2]) == len(hd[1]):  # the handle's first wait: every param cat'ed
                        for q in hd[1]:
                            serial += 1
                            storage[q] = (serial, w * tr.numel[q], "temporary")
                    hd[2].discard(p)
                    if not hd[2]:
                        del handles[h]
            if mo != emb and ((forward and not (ac and in_block(mo))) or (ac and kind == "F" and not forward)):
                saved.update(storage[p][0] for p in tr.mod_params[mo] if two_d[p] and p in storage)
        else:
            for p in ev[2]:
                storage.pop(p, None)
        if i in ats:
            snaps[i] = (dict(storage), sum(hd[0] for hd in handles.values()))
    out = []
    for at in ats:
        if at not in snaps:
            raise ValueError(f"event {at} is not an event of the pass before its last moment")
        snap, flat = snaps[at]
        got = {"saved": 0, "gathered": flat, "temporary": 0}
        for sr, nb, cat in snap.values():
            got["saved" if sr in saved else cat] += nb
        out.append(Z3Live(**got))
    return tuple(out)




def _per_log(logs: list[list], walk) -> tuple:
    """walk(log) per pass, once per log object: the passes of a fixed point share one
    (coordinator.pass_logs)."""
    done: dict[int, object] = {}
    out = []
    for log in logs:
        if id(log) not in done:
            done[id(log)] = walk(log)
        out.append(done[id(log)])
    return tuple(out)


def _fetch_at(log: list, kind: str, mod: int, nth: int = 0) -> int:
    """The index of the nth event of `kind` of module `mod` in a pass's log (the scan stops there)."""
    return next(islice((i for i, ev in enumerate(log) if ev[0] == kind and ev[1] == mod), nth, None))


@lru_cache(maxsize=64)
def z3_moments(model: ModelShape, m: int, threshold: int, prefetch: int, max_live: int, reuse: int, dp: int,
               w: int, first: bool = False, ac: bool = False) -> tuple[tuple[Z3Live, Z3Live, Z3Live], ...]:
    """Per micro-batch of a steady step (the passes of coordinator.z3_steady, on the event-by-event
    replay), the gathered parameter memory at three moments (after the fetch and its prefetch):
    - the final norm's forward: every layer's activations live, the output's all-gather not waited yet;
    - the backward's start (the root's pre-backward hook on the loss, before the loss's own backward
      nodes): what the forward left gathered and the root's prefetch;
    - the output Linear's backward (its pre-backward hook on the logits' gradient).
    first: the same for step 0's passes (coordinator.pass_logs: its recording pass with one
    micro-batch, no prefetch, every fetched param released after its module, persistent ones too)."""
    tr = z3_trace(model, threshold, ac)
    norm, out_mod = 2 + tr.layers * modules_per_block(tr), 3 + tr.layers * modules_per_block(tr)
    return _per_log(pass_logs(model, m, threshold, prefetch, max_live, reuse, first, ac), lambda log: _z3_walk(
        model, tr, log, dp, w, (_fetch_at(log, "F", norm), _fetch_at(log, "B", 0), _fetch_at(log, "B", out_mod)),
        ac))


def z3_first_moments(model: ModelShape, m: int, threshold: int, prefetch: int, max_live: int, reuse: int, dp: int,
                     w: int, ac: bool = False) -> tuple[tuple[Z3Live, Z3Live, Z3Live], ...]:
    """z3_moments for step 0's passes."""
    return z3_moments(model, m, threshold, prefetch, max_live, reuse, dp, w, True, ac)


@lru_cache(maxsize=64)
def z3_backward_moments(model: ModelShape, m: int, threshold: int, prefetch: int, max_live: int, reuse: int,
                        dp: int, w: int, first: bool, mods: tuple[int, ...],
                        ac: bool = False) -> tuple[tuple[Z3Live, ...], ...]:
    """Per micro-batch (z3_moments' passes), the gathered parameter memory at each module of `mods`'s
    pre-backward fetch (and its prefetch): what the coordinator holds while that module's backward
    runs, its parameters' gradient hooks included (their post-backward release comes after)."""
    tr = z3_trace(model, threshold, ac)
    return _per_log(pass_logs(model, m, threshold, prefetch, max_live, reuse, first, ac),
                    lambda log: _z3_walk(model, tr, log, dp, w, tuple(_fetch_at(log, "B", mo) for mo in mods), ac))


@lru_cache(maxsize=64)
def z3_recompute_moments(model: ModelShape, m: int, threshold: int, prefetch: int, max_live: int, reuse: int,
                         dp: int, w: int, first: bool, mods: tuple[int, ...]) -> tuple[tuple[tuple[Z3Live, Z3Live], ...], ...]:
    """With checkpointing, per micro-batch (z3_moments' passes) and module of `mods` (each block's last
    module, its w2), the gathered parameter memory (a) at the module's fetch in its block's recompute
    (its second pre-forward fetch: the recompute's forward ends with it, every weight it saves gathered)
    and (b) right after the module's post-backward release (its PostBackwardFunctionModule, once its
    inputs' gradients are made): what the coordinator holds while the backward goes on below it."""
    tr = z3_trace(model, threshold, True)

    def walk(log):
        ats = [i for mo in mods for i in (_fetch_at(log, "F", mo, 1), _fetch_at(log, "b", mo))]
        got = _z3_walk(model, tr, log, dp, w, tuple(ats), True)
        return tuple(zip(got[::2], got[1::2]))
    return _per_log(pass_logs(model, m, threshold, prefetch, max_live, reuse, first, True), walk)
