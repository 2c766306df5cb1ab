"""The model-holding halves of the pipeline, as plain classes the actors wrap.

`TargetSide` owns the target `Transformer`, its paged KV cache and the
`verifier.Verifier`; `DraftSide` owns a proposer (`drafter.ModelProposer` with
its own draft KV cache, or `drafter.NgramProposer`). Both are built from
checkpoint directories inside the actor process (weights never travel through
Ray). No Ray here: the same classes run in a unit test.

The draft side drafts one level deeper than the tree it sends: the extra level
gives the drafter its guess of the bonus token (DESIGN §3 step 2) and its K/V
is needed for the next tree anyway, so it costs no extra forward in steady
state.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from drafter.streams import cut_tree, greedy_outcome, reroot

MAX_SPEC_LEN = 16
MAX_TREE_WIDTH = 8
MAX_BRIDGE_DEPTH = 4


@dataclass
class PipelineSettings:
    """Knobs shared by the actors of one pipeline (built from ClusterConfig, cluster/pipeline.py)."""

    mode: str = "auto"               # default speculation mode of a request
    spec_len: int = 4                # default K / tree depth
    tree_width: int = 1
    proposer: str = "model"
    ring_slots: int = 2              # trees in flight per sequence; 1 = lockstep (nothing assumed)
    lockstep_alone: bool = True      # lockstep too while a CPU drafter beside its verifier has one stream
    lockstep_shared_gpu: bool = True  # lockstep while drafter and verifier run on the same GPU
    max_batch_size: int = 32         # sequences per verifier forward
    num_blocks: int = 1024           # target KV blocks (the drafter gets as many)
    block_size: int = 16
    num_cpus: float = 1.0            # torch threads of each actor
    device: str = "cpu"
    dtype: str = "float32"
    drafter_timeout_s: float = 2.0   # a drafter silent this long is treated as dead
    max_tree_wait_s: float = 0.5     # longest a sequence is held back for a late tree
    poll_s: float = 0.05             # verifier idle poll; the drafter long-polls max(this, timeout / 4)
    replay_file: str | None = None   # BENCHMARK ONLY (proposer "replay", cluster/replay.py)
    replay_corruption: float = 0.0
    # torch threads of a CPU verifier's step while its drafters have nothing to draft:
    # -1 = its own plus the CPUs of the live drafters on its node (theirs sit idle then);
    # 0 = its own only; n > 0 = n (see `plain_step_threads`)
    plain_threads: int = -1
    # a sequence in "auto" mode whose draft model is off (budget 0, no drafter tree) may
    # still speculate with prompt lookup drafted by the verifier itself, where it pays
    lookup: bool = True
    # tokens of the draft's own greedy chain a bridge step verifies (drafter/streams.py: the
    # verifier holds a copy of the draft); 0 = a bridge decodes one token alone
    bridge_depth: int = 0
    # after a contradicted outcome, the depth of the short restart tree the drafter drafts
    # after the committed prefix while the verifier waits for it (drafter/streams.py);
    # 0 = the verifier bridges instead
    restart_depth: int = 0


def bridge_chain_depth(settings: PipelineSettings, params, budget: int) -> int:
    """Draft tokens a bridge step of this sequence verifies, decided alike by both sides: the
    setting, for greedy requests with a draft model, within the sequence's budget (the
    verifier's last signal; 0 = decode alone)."""
    if settings.bridge_depth <= 0 or settings.proposer != "model" or not params.greedy:
        return 0
    return max(0, min(settings.bridge_depth, budget, MAX_BRIDGE_DEPTH))


def restart_tree_depth(settings: PipelineSettings, budget: int) -> int:
    """Depth of the restart tree that follows a contradicted outcome, decided alike by both
    sides: the setting within the sequence's budget (the verifier's last signal); 0 = the
    verifier bridges instead (the setting is 0, or speculation is off for the sequence)."""
    return max(0, min(settings.restart_depth, budget))


def next_tree_shape(settings: PipelineSettings, params, budget: tuple[int, int],
                    contradicted: bool) -> tuple[int, int, int]:
    """The drafter's next tree for a sequence: (depth, width, bridge), `bridge` the tokens the
    verifier's bridge step is assumed to commit before it (0: none; `DraftSide.propose`).
    After a contradicted outcome: a restart chain (`restart_tree_depth`), else the restart
    tree after a bridge of one token or a bridge chain's r plus one (drafter/streams.py)."""
    k, width = budget
    if not contradicted:
        return k, width, 0
    restart = restart_tree_depth(settings, k)
    if restart:
        return restart, 1, 0
    return k, width, 1 + bridge_chain_depth(settings, params, k)


def set_threads(num_cpus: float) -> None:
    """One intra-op thread per reserved CPU (at least one): actors must not oversubscribe."""
    torch.set_num_threads(threads_of(num_cpus))


def threads_of(num_cpus: float) -> int:
    return max(1, int(num_cpus))


def plain_step_threads(setting: int, own: int, device: str, node: str, drafters: list[dict]) -> int:
    """Threads for a verifier step taken while no drafter has work (every sequence decodes alone).

    On a CPU node the drafter's cores then idle: a plain step may use them, so that an
    asynchronous pipeline with speculation switched off decodes as fast as the target
    alone on the same cores instead of on the verifier's share of them. `drafters`: the
    live drafters, each {"node": node id, "cpus": CPUs it reserved}; only those on the
    verifier's own `node` lend their cores. GPU verifiers keep `own`.
    """
    if device != "cpu" or setting == 0:
        return own
    if setting > 0:
        return setting
    return own + sum(threads_of(d.get("cpus", 0)) for d in drafters if node and d.get("node") == node)


def gpu_ids(device: str) -> list[str] | None:
    """The GPUs Ray gave this actor (ids as Ray names them), [] where it named none; None off a
    GPU (`device` "cpu")."""
    import ray

    if device == "cpu":
        return None
    if not ray.is_initialized():
        return []
    return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def shares_gpu(node: str, gpus: list[str] | None, other_node: str, other_gpus: list[str] | None) -> bool:
    """Whether two actors run on one GPU: the same node and a GPU id in common, or both on a GPU
    with none named (each then uses the node's first visible device). Two processes on one GPU
    have their kernels time-sliced, so overlapping their forwards gains nothing (cluster/actors.py)."""
    if gpus is None or other_gpus is None or not node or node != other_node:
        return False
    return bool(set(gpus) & set(other_gpus)) or (not gpus and not other_gpus)


def in_lockstep(settings: PipelineSettings, streams: int, on_cpu: bool,
                drafter_node: str, drafter_cpus: float, drafter_gpus: list[str] | None,
                verifier_node: str, verifier_cpus: float, verifier_gpus: list[str] | None) -> bool:
    """Whether a drafter runs in lockstep with its verifier (one tree in flight, nothing
    assumed past it), decided the same way by each side from its own view
    (`DrafterActor._lockstep`, `VerifierActor._lockstep`): always with `ring_slots` 1; with
    `lockstep_shared_gpu` while the two share a GPU (`shares_gpu`); with `lockstep_alone`
    while the drafter, on the verifier's node and with at least its CPUs, serves one stream
    (`streams`) and the deciding side runs on a CPU (`on_cpu`: the verifier then verifies on
    the drafter's cores too)."""
    if settings.ring_slots == 1:
        return True
    if settings.lockstep_shared_gpu and shares_gpu(drafter_node, drafter_gpus, verifier_node, verifier_gpus):
        return True
    return (settings.lockstep_alone and on_cpu and streams == 1 and bool(drafter_node)
            and drafter_node == verifier_node and drafter_cpus >= verifier_cpus > 0)


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _load(spec: str, device: str, dtype: str):
    """A checkpoint directory, or `random:<preset>` (benchmark only, cluster/replay.py)."""
    from cluster.replay import is_random, random_model
    from models import cuda_graphs

    if is_random(spec):
        model = random_model(spec, device, getattr(torch, dtype))
    else:
        from models import load_model

        model = load_model(spec, device=device, dtype=getattr(torch, dtype))
    cuda_graphs.enable(model)   # small forwards as CUDA graphs on a GPU (SPECFLASH_CUDA_GRAPHS=0: eager)
    return model


def _config_of(spec: str):
    from cluster.replay import is_random, random_config

    if is_random(spec):
        return random_config(spec)
    from models.loader import load_config

    return load_config(spec)


def eos_ids_of(target_dir: str | Path) -> list[int]:
    """EOS ids of the target: config.json's plus the tokenizer's, when it has one."""
    from cluster.replay import is_random
    from models.loader import load_config

    if is_random(str(target_dir)):
        return []

    eos = set(load_config(target_dir).eos_token_ids)
    if any((Path(target_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from models import load_tokenizer

        tok_eos = load_tokenizer(target_dir).eos_token_id
        if tok_eos is not None:
            eos.add(tok_eos)
    return sorted(eos)


class TargetSide:
    """Target model + paged KV cache + Verifier; one forward per verification step."""

    def __init__(self, target_dir: str, num_blocks: int, block_size: int = 16,
                 device: str = "cpu", dtype: str = "float32") -> None:
        from verifier import Verifier

        model = _load(target_dir, device, dtype)
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        self.max_context = model.config.max_position_embeddings
        self.verifier = Verifier(model, model.new_cache(num_blocks, block_size))
        self.graphs = getattr(model, "graphs", None)     # models.cuda_graphs.GraphedLayers on a GPU

    @property
    def cache(self):
        return self.verifier.cache

    def prefill(self, seq_id: str, prompt: list[int]) -> None:
        self.verifier.prefill(seq_id, prompt)

    def verify(self, requests: list, threads: int | None = None) -> tuple[list, float]:
        """`requests`: verifier.VerifyRequest list. Returns (VerifyResult list, seconds).

        `threads`: torch threads for this forward, set in the calling thread (OpenMP's
        thread count is a per-thread setting).
        """
        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        start = time.perf_counter()
        results = self.verifier.verify(requests)
        return results, time.perf_counter() - start

    def release(self, seq_id: str) -> None:
        self.verifier.release(seq_id)

    def warm_up(self, spec_len: int, prompt_len: int = 32, on_cpu: bool = False) -> float:
        """On a GPU (or with `on_cpu`, for tests), before the actor serves: one dummy sequence
        through a prefill, plain steps and chain verifications of 1..`spec_len` nodes, each
        shape twice, so that Triton compiles those kernels and the CUDA graphs of one sequence
        are captured now rather than inside the first requests (on an H200 a cold first draft
        took 5 s, long enough for the verifier to count its drafter as gone,
        bench/results/gpu-20261130c/). Returns the seconds it took (0 on a CPU: nothing is
        compiled or captured there)."""
        if self.cache.device.type != "cuda" and not on_cpu:
            return 0.0
        from models.sampling import SamplingParams
        from models.tree import TokenTree
        from verifier import VerifyRequest

        start, sid = time.perf_counter(), "__warm_up__"
        committed = [1] * prompt_len
        params, gen = SamplingParams(temperature=0.0), torch.Generator().manual_seed(0)
        self.prefill(sid, committed)
        try:
            for k in [0, 0] + [k for k in range(1, spec_len + 1) for _ in (0, 1)]:
                tree = TokenTree.empty(len(committed)) if k == 0 else TokenTree.chain([1] * k, None, len(committed))
                res = self.verifier.verify([VerifyRequest(sid, committed[-1], tree, params, gen)])[0]
                committed += res.token_ids
        finally:
            self.release(sid)
        return time.perf_counter() - start


def draft_proposer(draft_dir: str, vocab: int, settings: PipelineSettings, levels: int):
    """The draft model as a `drafter.ModelProposer` with its own KV cache, drafting up to
    `levels` deep, read as the pipeline reads it (its reduced head, fp16 copies): what a
    drafter and a verifier's bridge chains both draft with."""
    from cluster.engine import read_logit_rows
    from cluster.replay import is_random
    from drafter import ModelProposer

    model = _load(draft_dir, settings.device, settings.dtype)
    rows = None if is_random(draft_dir) else read_logit_rows(draft_dir, vocab)
    return ModelProposer(model, model.new_cache(settings.num_blocks, settings.block_size), levels, 1, None,
                         rows, vocab)


@dataclass
class Drafted:
    tree: object               # models.tree.TokenTree cut to the requested depth
    outcome: list[int] | None  # assumed committed tokens: greedy path + bonus guess
    bridge_tokens: list[int] | None = None   # bridge: the guessed tokens the tree is drafted after
    cached: list[int] | None = None   # tokens whose draft K/V were kept (the assumed path)


class DraftSide:
    """A proposer driven on assumed prefixes (draft-ahead) with explicit rollback."""

    def __init__(self, draft_dir: str | None, target_dir: str, settings: PipelineSettings) -> None:
        from cluster.replay import CorruptedReplayProposer
        from drafter import DraftRequest, NgramProposer
        from models.eagle import refuse_in_pipeline

        st = settings
        self.graphs = None
        self._request_cls = DraftRequest
        self._has_width = "tree_width" in {f.name for f in fields(DraftRequest)}
        vocab = _config_of(target_dir).vocab_size
        if st.proposer == "ngram" or draft_dir is None:
            self.proposer = NgramProposer(vocab, MAX_SPEC_LEN + 1)
            self.kind = "ngram"
            return
        refuse_in_pipeline(draft_dir)
        # levels: a tree, its bonus guess and a bridge chain's tokens plus its guess
        self.proposer = draft_proposer(draft_dir, vocab, st, MAX_SPEC_LEN + MAX_BRIDGE_DEPTH + 2)
        self.graphs = getattr(self.proposer.model, "graphs", None)
        self.kind = "model"
        if st.proposer == "replay":       # BENCHMARK ONLY: controlled acceptance (cluster/replay.py)
            self.proposer = CorruptedReplayProposer.from_file(self.proposer, st.replay_file,
                                                              st.replay_corruption, vocab)
            self.kind = "replay"

    @property
    def cache(self):
        return getattr(self.proposer, "cache", None)

    def propose(self, items: list[tuple], assume: bool = True) -> tuple[list[Drafted], float]:
        """`items`: (seq_id, prefix tokens, params, generator, spec_len, width, epoch, bridge),
        `bridge` the number of tokens the verifier's bridge step is assumed to commit (0: none).

        One batched call drafts every sequence to depth spec_len + 1 (+ `bridge` more);
        each tree is cut to spec_len and the extra level gives the bonus guess. A
        bridge tree is the subtree under the `bridge`-th node of the first-child path
        from the root, drafted after prefix + that path's tokens (drafter/streams.py). With
        `assume=False` (lockstep: nothing is drafted past a tree in flight) there is
        no bonus guess to make: trees are drafted to spec_len and carry no outcome.
        Returns the drafts and the seconds the batch took.
        """
        start = time.perf_counter()
        batch = []
        for seq_id, tokens, params, gen, k, width, epoch, bridge in items:
            kw = {"epoch": epoch}
            if self._has_width:
                kw["tree_width"] = width
            batch.append(self._request_cls(seq_id, tokens, params, gen, k + int(assume) + int(bridge), **kw))
        trees = self.proposer.propose(batch)
        out = []
        for (seq_id, *_, k, _w, _e, bridge), tree in zip(items, trees):
            out.append(self._assume(seq_id, tree, k, bridge))
        return out, time.perf_counter() - start

    def _assume(self, seq_id: str, tree, k: int, bridge: int) -> Drafted:
        """Cut the tree, work out its assumed outcome, and keep the assumed path's draft K/V."""
        full, bridge_tokens, prefix_nodes, index = tree, None, [], None
        if bridge and tree.num_nodes:
            lead, lead_tokens, _ = greedy_outcome(tree, int(bridge))
            if len(lead) < int(bridge):             # the draft stopped short: nothing to assume
                return Drafted(cut_tree(tree, 0), None)
            bridge_tokens, prefix_nodes = lead_tokens, lead
            tree, index = reroot(tree, lead[-1])
        path, path_tokens, guess = greedy_outcome(tree, k)
        # the draft keeps the K/V of the assumed path, exactly what full acceptance leaves
        full_path = prefix_nodes + (path if index is None else [index[i] for i in path])
        self.proposer.on_verified(seq_id, full, full_path)
        outcome = None if guess is None else path_tokens + [guess]
        return Drafted(cut_tree(tree, k), outcome, bridge_tokens, path_tokens)

    def rollback(self, seq_id: str, keep_len: int) -> None:
        """Forget draft state past the first keep_len tokens (epoch change, DESIGN §3 step 4)."""
        if hasattr(self.proposer, "rollback"):
            self.proposer.rollback(seq_id, keep_len)

    def release(self, seq_id: str) -> None:
        self.proposer.release(seq_id)

    def warm_up(self, spec_len: int, prompt_len: int = 32, on_cpu: bool = False) -> float:
        """On a GPU (or with `on_cpu`, for tests), before the actor serves: draft for one dummy
        sequence at every depth up to `spec_len` (+ the bonus and bridge levels), with and
        without an assumed outcome, each twice (`TargetSide.warm_up`: Triton compiles and
        CUDA-graph captures happen now). Returns the seconds it took (0 on a CPU or without a
        draft model)."""
        cache = self.cache
        if self.kind == "ngram" or cache is None or (cache.device.type != "cuda" and not on_cpu):
            return 0.0
        from models.sampling import SamplingParams

        start, sid = time.perf_counter(), "__warm_up__"
        params, gen = SamplingParams(temperature=0.0), torch.Generator().manual_seed(0)
        prefix = [1] * prompt_len
        try:
            for k in range(1, spec_len + 1):
                for assume, bridge in ((True, 0), (True, 1), (False, 0)):
                    for _ in (0, 1):
                        self.propose([(sid, prefix, params, gen, k, 1, 0, bridge)], assume)
                        self.rollback(sid, len(prefix) - 1)
        finally:
            self.release(sid)
        return time.perf_counter() - start


class BridgeDraft:
    """The verifier's copy of the draft model, for bridge chains (`bridge_depth`,
    drafter/streams.py): after a step whose outcome contradicted what the drafter assumed,
    the verifier verifies the draft's own greedy chain instead of decoding one token alone,
    drafted here in one batched pass with its own KV cache (caught up on the committed
    tokens at each use). The drafter drafts the same greedy path, and its restart tree after
    it, at the same time on its own device."""

    def __init__(self, draft_dir: str, target_dir: str, settings: PipelineSettings) -> None:
        from drafter import DraftRequest

        self._request_cls = DraftRequest
        # as the drafter's proposer reads it: the same greedy path
        self.proposer = draft_proposer(draft_dir, _config_of(target_dir).vocab_size, settings, MAX_BRIDGE_DEPTH + 1)

    def chains(self, items: list[tuple]) -> list[tuple[object, list[int] | None]]:
        """`items`: (seq_id, committed tokens, params, generator, depth r). Returns per item the
        chain cut to r (a TokenTree) and the outcome it announces: the chain plus the draft's
        next token (None where the draft stopped short)."""
        batch = [self._request_cls(seq_id, tokens, params, gen, depth + 1, epoch=0, tree_width=1)
                 for seq_id, tokens, params, gen, depth in items]
        out = []
        for (seq_id, committed, _, _, depth), tree in zip(items, self.proposer.propose(batch)):
            _, tokens, guess = greedy_outcome(tree, depth)
            out.append((cut_tree(tree, depth), None if guess is None else tokens + [guess]))
            # keep the committed prefix but its root, which the next chain feeds afresh
            self.proposer.rollback(seq_id, len(committed) - 1)
        return out

    def release(self, seq_id: str) -> None:
        self.proposer.release(seq_id)

    def warm_up(self, depth: int, prompt_len: int = 32, on_cpu: bool = False) -> float:
        """On a GPU (or with `on_cpu`, for tests), before the verifier serves: chains of 1..`depth`
        for a dummy sequence, each twice (as `DraftSide.warm_up`). Returns the seconds taken."""
        cache = self.proposer.cache
        if cache.device.type != "cuda" and not on_cpu:
            return 0.0
        from models.sampling import SamplingParams

        start, sid = time.perf_counter(), "__warm_up__"
        params, gen = SamplingParams(temperature=0.0), torch.Generator().manual_seed(0)
        try:
            for r in [r for r in range(1, depth + 1) for _ in (0, 1)]:
                self.chains([(sid, [1] * prompt_len, params, gen, r)])
        finally:
            self.release(sid)
        return time.perf_counter() - start
