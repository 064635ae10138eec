"""Tensor parallel for the transformer: attention split by heads, vocabulary-parallel embedding,
head and cross-entropy, each equal to the unsharded model, and the bytes they send equal to the
analytic volumes.

Tolerance: one forward/backward of a model whose sums are split over ranks differs from the
unsharded one by rounding only. Both run in float64 and are compared within
``distlab.tools.verify.step_tolerance`` (every term that feeds one value -- tokens x widest
dimension x layers -- at the largest magnitude seen: ~2e-5 here), far below what a wrong shard or a missing
reduction moves (1e-2 and more). Bytes on the wire are counted for float64 (8 bytes a value).
"""

import copy

import pytest
import torch
import torch.distributed as dist

from distlab import comm
from distlab.comm.accounting import allreduce_bytes_per_rank
from distlab.models import GPT, task_correct, task_loss
from distlab.parallel import apply_tensor_parallel
from distlab.parallel.placement import full_parameters, full_state_dict
from distlab.parallel.loss_head import vocab_parallel_head
from distlab.models import IGNORE_INDEX
from distlab.parallel.tensor_parallel.vocabulary import vocab_parallel_correct, vocab_parallel_cross_entropy
from distlab.launch.spawn import RankFailure, run_ranks
from distlab.tools.verify import step_tolerance, sum_tolerance
from tests.conftest import patience

B, T, C, L, HEADS, V = 3, 8, 16, 2, 4, 256
ITEM = 8  # bytes of one float64 value


def _gpt(vocab=V):
    torch.manual_seed(0)
    return GPT(vocab, T, n_layer=L, n_head=HEADS, n_embd=C).double()


def _one_step(rank, world, sp=False, vocab=V, smoothing=0.0):
    full = _gpt(vocab)
    sharded = apply_tensor_parallel(copy.deepcopy(full), dist.group.WORLD, sequence_parallel=sp)
    head = vocab_parallel_head(sharded)  # the LM head's output layer, split by vocabulary
    x = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(2))
    ref_loss = task_loss(full(x), y, label_smoothing=smoothing)
    ref_loss.backward()
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with comm.counting() as fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = sharded(x)
        loss = head.loss(out, y, label_smoothing=smoothing)
    with comm.counting() as bwd:
        loss.backward()
    bound = (step_tolerance(full, B * T, ref_loss), step_tolerance(full, B * T, ref_loss, dtype=torch.float32))
    lr = 0.5
    with torch.no_grad():
        for p in list(full.parameters()) + list(sharded.parameters()):
            p -= lr * p.grad
    param_diff = max((a - b.detach()).abs().max().item() for a, b in zip(full_parameters(sharded), full.parameters()))
    keys_equal = list(full_state_dict(sharded)) == list(full.state_dict())
    local_vocab = out.shape[-1]
    return (abs(loss.item() - ref_loss.item()), param_diff, keys_equal, local_vocab, fwd.calls, bwd.calls,
            fwd.bytes_sent, bwd.bytes_sent, type(head).__name__, type(sharded[0].tok).__name__, sum(saved), bound)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_transformer_equals_the_unsharded_one_and_sends_the_analytic_bytes(world):
    act = B * T * C * ITEM         # one activation tensor (B, T, C) in bytes
    per_token = B * T * ITEM       # one value per token
    for r in run_ranks(_one_step, world, timeout=120):
        loss_diff, param_diff, keys_equal, local_vocab, fwd_calls, bwd_calls, fwd_bytes, bwd_bytes, head, emb, _, \
            (tol, float32_tol) = r
        assert tol < float32_tol and loss_diff <= tol and param_diff <= tol and keys_equal
        assert local_vocab == V // world and head == "VocabParallelLinear" and emb == "VocabParallelEmbedding"
        # forward: embedding, then attention and MLP per block, then max / sum / target logit of the loss
        assert fwd_calls == 1 + 2 * L + 3
        assert fwd_bytes == allreduce_bytes_per_rank(act, world) * (1 + 2 * L) + \
            3 * allreduce_bytes_per_rank(per_token, world)
        # backward: one input-gradient all-reduce per attention (not one each for q, k, v), one per
        # MLP, one for the head's input; the embedding's is identity
        assert bwd_calls == 2 * L + 1
        assert bwd_bytes == allreduce_bytes_per_rank(act, world) * (2 * L + 1)


@pytest.mark.parametrize("world", [2, 4])
def test_a_vocabulary_tensor_parallel_does_not_divide_is_cut_unevenly_and_trains_as_the_whole_model(world):
    """A vocabulary of 257 tokens on 2 or 4 ranks (refused before): ``torch.chunk``'s cut -- 129 + 128, or 65 x 3
    + 62 rows -- in the embedding and the head alike; the loss (label smoothing's mean over the 257 real
    tokens included), every updated parameter and the whole state dict equal the unsharded model's within
    rounding, so nothing is padded that could be predicted and the whole tensors are the model's own."""
    sizes = [len(c) for c in torch.arange(257).chunk(world)]
    results = run_ranks(_one_step, world, False, 257, 0.1, timeout=patience(120))
    for rank, r in enumerate(results):
        loss_diff, param_diff, keys_equal, local_vocab, *_, (tol, _) = r
        assert loss_diff <= tol and param_diff <= tol and keys_equal, (loss_diff, param_diff, tol)
        assert local_vocab == sizes[rank]


def _loss_and_accuracy(rank, world, smoothing=0.0, ignored=False):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 7, 12, generator=g, dtype=torch.float64)
    logits[0, 0, 3] = logits[0, 0, 9] = 50.0          # a tie: argmax takes the lowest id, 3
    target = torch.randint(0, 12, (5, 7), generator=g)
    target[0, 0] = 3
    if ignored:  # flash-attention's parallel cross-entropy test: some targets ignored (a whole sequence too)
        target[torch.rand(5, 7, generator=g) < 0.4] = IGNORE_INDEX
        target[2] = IGNORE_INDEX
    mine = logits.chunk(world, -1)[rank].clone().requires_grad_()
    start = rank * (12 // world)
    loss = vocab_parallel_cross_entropy(mine, target, dist.group.WORLD, start, label_smoothing=smoothing)
    loss.backward()
    full = logits.clone().requires_grad_()
    ref = task_loss(full, target, label_smoothing=smoothing)
    ref.backward()
    grad_diff = (mine.grad - full.grad.chunk(world, -1)[rank]).abs().max().item()
    # the loss: a sum over 12 logits per token (its log-sum-exp), then a mean over 35 tokens, of values <= 50
    bound = sum_tolerance(12 * 35, 50.0, torch.float64), sum_tolerance(12 * 35, 50.0, torch.float32)
    return abs(loss.item() - ref.item()), grad_diff, vocab_parallel_correct(mine, target, dist.group.WORLD, start), \
        task_correct(logits, target), bound


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_cross_entropy_and_accuracy_equal_the_gathered_ones(world):
    for loss_diff, grad_diff, correct, expected, (bound, float32_bound) in run_ranks(_loss_and_accuracy, world,
                                                                                     timeout=60):
        assert bound < float32_bound and loss_diff <= bound and grad_diff <= bound and correct == expected
    for loss_diff, grad_diff, _, _, (bound, _) in run_ranks(_loss_and_accuracy, world, 0.1, timeout=60):
        assert loss_diff <= bound and grad_diff <= bound  # label smoothing: F.cross_entropy's, on the gathered logits
    # ignored targets: torch's mean over the kept ones, smoothed or not; accuracy counts the kept ones only
    for smoothing in (0.0, 0.1):
        for loss_diff, grad_diff, correct, expected, (bound, _) in run_ranks(_loss_and_accuracy, world, smoothing,
                                                                             True, timeout=60):
            assert loss_diff <= bound and grad_diff <= bound and correct == expected and expected[1] < 35


def _ignored_per_token(rank, world, smoothing):
    """Per token: an ignored target's loss is exactly 0 and its logits' gradient exactly 0."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(16, 8 * world, generator=g)
    target = torch.randint(0, 8 * world, (16,), generator=g)
    target[::3] = IGNORE_INDEX
    mine = logits.chunk(world, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, target, dist.group.WORLD, rank * 8, reduction="none",
                                        label_smoothing=smoothing)
    loss.sum().backward()
    return loss.detach(), mine.grad, target


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_ignored_targets_score_nothing_and_send_no_gradient_across_the_vocabulary_shards(smoothing):
    for loss, grad, target in run_ranks(_ignored_per_token, 2, smoothing, timeout=60):
        ignored = target == IGNORE_INDEX
        assert (loss[ignored] == 0).all() and (grad[ignored] == 0).all()
        assert (loss[~ignored] > 0).all() and (grad[~ignored].abs().sum(-1) > 0).all()


def _megatron_case(rank, world, smoothing):
    """Megatron-LM's own test of its vocabulary-parallel cross-entropy: 4 ranks each hold logits 0..7
    repeated (16 tokens x 32 of a 128-token vocabulary), the targets are 0, 2, .., 30."""
    mine = torch.arange(0, 8, dtype=torch.float32).repeat(16, 4).requires_grad_()
    target = torch.arange(0, 32, 2)
    loss = vocab_parallel_cross_entropy(mine, target, dist.group.WORLD, rank * 32, reduction="none",
                                        label_smoothing=smoothing)
    loss.sum().backward()
    full = torch.arange(0, 8, dtype=torch.float32).repeat(16, 16).requires_grad_()
    ref = task_loss(full, target, reduction="none", label_smoothing=smoothing)
    ref.sum().backward()
    return loss.detach(), ref.detach(), (mine.grad - full.grad.chunk(world, -1)[rank]).abs().max().item()


def test_vocab_parallel_cross_entropy_gives_megatrons_literal_values_and_smooths_as_torch_does():
    megatron = torch.tensor([10.2309, 8.2309, 6.2309, 4.2309] * 4)  # its expected output, to 4 decimals
    # 128 logits per token, each at most 7: log-sum-exp's float32 rounding, far below the literal's 5e-5
    bound = 5e-5 + sum_tolerance(128, 7.0, torch.float32)
    grad_bound = sum_tolerance(128, 1.0, torch.float32)  # softmax: each exponential (<= 1) over their sum of 128
    for loss, ref, grad_diff in run_ranks(_megatron_case, 4, 0.0, timeout=60):
        assert (loss - megatron).abs().max() <= bound and (loss - ref).abs().max() <= bound and grad_diff <= grad_bound
    for loss, ref, grad_diff in run_ranks(_megatron_case, 4, 0.2, timeout=60):
        assert (loss - ref).abs().max() <= bound and grad_diff <= grad_bound
        assert (loss - megatron).abs().min() > 0.1  # smoothing changed the loss (by 0.2 x (mean -log p - nll))


def _shard_odd_heads(rank, world):
    apply_tensor_parallel(GPT(V, T, n_layer=1, n_head=3, n_embd=12), dist.group.WORLD)


def test_heads_the_group_does_not_divide_are_refused():
    with pytest.raises(RankFailure, match="`n_head` 3 is not divisible by 2"):
        run_ranks(_shard_odd_heads, 2, timeout=60)


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_equals_the_unsharded_model_moves_the_same_bytes_and_saves_less(world):
    """The LayerNorm/residual regions split along the sequence: the same function, the same
    activation bytes on the wire (all-gather + reduce-scatter = all-reduce), plus one all-reduce
    per gradient of the parameters those regions hold; fewer activation bytes saved for backward."""
    plain = run_ranks(_one_step, world, False, timeout=120)
    split = run_ranks(_one_step, world, True, timeout=120)
    for p, s in zip(plain, split):
        loss_diff, param_diff, keys_equal, _, fwd_calls, bwd_calls, fwd_bytes, bwd_bytes, _, _, saved, \
            (tol, float32_tol) = s
        assert tol < float32_tol and loss_diff <= tol and param_diff <= tol and keys_equal
        assert fwd_bytes == p[6]  # forward: exactly the bytes of the all-reduces it replaces
        assert fwd_calls == 1 + 4 * L + 1 + 3
        # backward: the same activation bytes, plus one all-reduce per gradient of the parameters the
        # split regions hold: the position embedding (T x C), per block two LayerNorms and two
        # row-parallel biases (6 tensors of C), the head's LayerNorm (2 of C)
        shared = [T * C] + [C] * (6 * L + 2)
        assert bwd_bytes == p[7] + sum(allreduce_bytes_per_rank(ITEM * n, world) for n in shared)
        assert bwd_calls == 1 + 4 * L + 1 + len(shared)
        assert saved < p[10]  # activations kept for backward: the sequence-split regions hold 1/tp


def test_sequence_parallel_is_refused_where_it_cannot_apply():
    from distlab.errors import ConfigError
    from distlab.parallel import Strategy
    from distlab.train.config import TrainConfig
    with pytest.raises(ConfigError, match="needs `tp` of 2 or more"):
        Strategy.parse("allreduce+sp")
    assert str(Strategy.parse("allreduce+tp=2+sp")) == "allreduce+tp=2+sp"
    with pytest.raises(ConfigError, match="MLP.s tensor-parallel plan declares no sequence-parallel regions"):
        TrainConfig.from_flags(model="mlp", strategy=Strategy(tp=2, sequence_parallel=True)).validate(2)
    with pytest.raises(ConfigError, match="`block_size` 9"):
        TrainConfig.from_flags(model="gpt", dataset="synthetic-text", block_size=9,
                    strategy=Strategy(tp=2, sequence_parallel=True)).validate(2)


def test_a_run_whose_vocabulary_tp_does_not_divide_trains_reshards_exports_and_is_planned_exactly(run_cli, tmp_path):
    """`distlab train --tp 2` of a Llama over a 301-token BPE (refused before: "not divisible by 2"): it trains,
    the planner's model state is what the run measured to the byte (the first rank's 151 rows), its snapshot
    resumes on one process (resharded: the whole embedding has 301 rows) and exports with a vocabulary of 301."""
    import json
    from safetensors.torch import load_file
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n\n" * 200)
    model = ["--model", "llama", "--n-layer", "1", "--n-embd", "32", "--n-head", "4", "--block-size", "16",
             "--global-batch-size", "4"]
    args = ["train", *model, "--dataset", f"text:{tmp_path / 'corpus.txt'}", "--tokenizer", "bpe:301",
            "--lr-schedule", "constant", "--no-progress", "--snapshot-dir", str(tmp_path / "s")]
    run_cli(*args, "--nproc-per-node", "2", "--tp", "2", "--max-steps", "2", "--out", str(tmp_path / "tp"),
            check=True)
    measured = json.loads((tmp_path / "tp" / "summary.json").read_text())["model_state_bytes_per_rank"]
    run_cli("plan", *model, "--dataset", "synthetic-text", "--vocab-size", "301", "--tp", "2", "--json",
            str(tmp_path / "plan.json"), check=True)
    assert json.loads((tmp_path / "plan.json").read_text())["model_state_bytes_per_rank"] == measured
    proc = run_cli(*args, "--max-steps", "4", "--resume", "auto", "--out", str(tmp_path / "one"), check=True)
    assert "resharded from 2 ranks" in proc.stdout + proc.stderr, proc.stderr
    run_cli("export", str(tmp_path / "s" / "step-00000004"), "--format", "hf", "-o", str(tmp_path / "hf"), check=True)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 301
    assert load_file(tmp_path / "hf" / "model.safetensors")["model.embed_tokens.weight"].shape == (301, 32)
