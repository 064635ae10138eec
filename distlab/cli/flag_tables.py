"""The strategy's flags (shared by train and plan) and train's own: one row per config field, its help
written once here; :func:`distlab.cli.options.field_options` makes the click options, each default read
from its dataclass."""

from __future__ import annotations

import click

from distlab.cli.model_flags import model_help, model_options

STRATEGY_OPTIONS = [
    ("dp_sync", dict(default=None, help="Gradient sync: gather-scatter (via rank 0), allreduce (per parameter, after "
                     "backward), bucketed (overlapped with backward; the default), bucketed_plain (the same idea "
                     "alone: its oracle) or ddp (torch's DDP), or your own "
                     "SyncMethod subclass as path/to/file.py:NAME. With --zero: ZeRO's own reduce-scatter.")),
    ("collective", dict(default=None, help="Collective algorithm: native (gloo/NCCL), ring, ring_plain, butterfly, "
                        "butterfly_plain or direct (distlab.comm), auto (per collective, the one measured fastest), or your own "
                        "all-reduce as path/to/file.py:NAME (distlab.comm.user). Default: native for data "
                        "parallel's all-reduce, auto for --zero's reduce-scatter and all-gather.")),
    ("bucket_mb", dict(type=float, help="Bucket size in MB for --dp-sync bucketed and ddp.")),
    ("grad_accum", dict(type=int, help="Micro-batches per optimizer step (no communication until the last).")),
    ("sync_bn", dict(help="off, distlab (any device) or torch (nn.SyncBatchNorm, GPU only); statistics over the "
                     "data-parallel group. Or distlab's with your own input gradient as path/to/file.py:NAME "
                     "(the signature of distlab.parallel.sync_bn.input_gradient).")),
    ("find_unused", dict(is_flag=True, help="Parameters without a gradient in a step count as zero.")),
    ("tp", dict(type=int, help="Tensor-parallel size: ranks that split each Linear layer (must divide the world size).")),
    ("tp_style", dict(help="megatron (column then row parallel, one all-reduce each way per block) or naive "
                      "(every layer column parallel, activations all-gathered).")),
    ("sequence_parallel", dict(is_flag=True, help="With --tp on a transformer: LayerNorm and residual regions split "
                               "along the sequence (all-gather / reduce-scatter in place of all-reduce: same bytes, "
                               "1/tp of those activations).")),
    ("cp", dict(type=int, help="Context-parallel size: ranks that split every sequence for the whole model (a "
                "transformer; tp x cp x pp must divide the world size; --block-size divisible by 2 x cp).")),
    ("cp_style", dict(help="With --cp: ring (key/value blocks passed around the ring, exact online softmax) or "
                      "ulysses (all-to-all from sequence shards to head shards and back; heads divisible by cp), or "
                      "ring_plain (the ring as the idea reads, autograd keeping every block: the tuned ring's oracle).")),
    ("ep", dict(type=int, help="Expert-parallel size: data-parallel ranks that share out a mixture of experts' "
                "experts (--model gpt-moe; divides the data-parallel size and --experts), tokens exchanged by "
                "all-to-all.")),
    ("ep_dispatch", dict(help="With --ep: all_to_all (each token-slot sent only to the rank of its expert) or "
                         "all_gather (the plain dispatch: every slot to every rank, the answers reduce-scattered "
                         "home; the all-to-all's oracle).")),
    ("zero", dict(type=click.IntRange(0, 3), help="ZeRO stage over the data-parallel ranks: 1 shards optimizer "
                  "state, 2 also gradients, 3 also parameters.")),
    ("dp_shard", dict(type=int, help="With --zero: hybrid sharding (HSDP) -- ZeRO over groups of this many "
                      "consecutive data-parallel ranks (a node's, say), its shards replicated across the groups: "
                      "parameters gathered inside a group, only the reduced gradient shard crossing them "
                      "(default: shard over every data-parallel rank).")),
    ("zero_impl", dict(help="With --zero: tuned (buckets overlapped with backward, stage 3 gathering one module "
                       "at a time, with prefetch) or plain (the partition alone, distlab/parallel/zero/plain.py: "
                       "every parameter's shard, reduce-scattered after backward, gathered whole).")),
    ("activation_checkpointing", dict(is_flag=True, help="Keep only each block's input (VGG stage, ResNet block, "
                                      "transformer block) and recompute the rest in backward: less activation "
                                      "memory for about a third more compute.")),
    ("ac_every", dict(type=int, help="With --activation-checkpointing: recompute one block in every K (the "
                      "first, then every K-th): selective checkpointing per block, less recomputation for more "
                      "memory (default 1: every block).")),
    ("ac_policy", dict(help="With --activation-checkpointing: what a checkpointed block keeps -- block (its input "
                       "alone, the default) or ops (also the outputs of attention and of every other matrix "
                       "multiplication: selective checkpointing per op, recomputing the cheap rest).")),
    ("compile", dict(is_flag=True, help="Each block (transformer block, ResNet block, VGG stage's layers) through "
                     "torch.compile: fused kernels, the same parameters and snapshots; the first step pays the "
                     "compilation. Composes with every layout but the zero-bubble pipeline.")),
    ("compile_backend", dict(help="With --compile: torch.compile's backend -- inductor (fused kernels, on a CPU built "
                             "by a C++ compiler), aot_eager (the same graphs run by eager kernels) or eager.")),
    ("precision", dict(help="fp32, bf16 (autocast in bfloat16: CPU and GPU) or fp16 (autocast in float16 with dynamic "
                       "loss scaling: GPU only); parameters and optimizer state stay float32.")),
    ("reduce_dtype", dict(default=None, help="Dtype gradients are communicated in: fp32, bf16 or fp16 (default: "
                          "the gradients' own, float32).")),
    ("grad_compression", dict(help="none, fp16, bf16 or powersgd:R (rank-R PowerSGD with error feedback and warm "
                              "start; --dp-sync allreduce, bucketed or ddp, the last through torch's hooks).")),
    ("pp", dict(type=int, help="Pipeline stages: the model's layers cut into this many parts on as many ranks "
                "(tp x pp must divide the world size; the rest is data parallel).")),
    ("microbatches", dict(type=int, default=None, help="With --pp: micro-batches per step on each pipeline (must "
                          "divide the per-rank batch; default --pp).")),
    ("pp_schedule", dict(help="With --pp: gpipe (all forwards, then all backwards), 1f1b (one forward, one "
                         "backward: at most --pp micro-batches held) or zb (zero bubble: each backward split into "
                         "the input's gradient and the weights', which fill 1F1B's idle slots).")),
    ("pp_virtual", dict(type=int, help="With --pp: model chunks per pipeline rank (interleaved 1F1B, bubble "
                        "(P-1)/(V M + P-1); --microbatches a multiple of --pp; or zero bubble).")),
    ("pp_balance", dict(default=None, help="With --pp: layers per stage, comma-separated (default: cut where the "
                        "parameters balance; the header lists the layers).")),
    ("components", dict(default=None, help="Model-sharding components of your own, by the names they are "
                        "registered under (DISTLAB_COMPONENTS=NAME=module:Class), colon-separated; applied after "
                        "the built-in ones.")),
    ("dims", dict(default=None, help="Sizes of the mesh dimensions your own components own, NAME=N, comma-"
                  "separated (in a strategy's text: +NAME=N); the data-parallel size shrinks by them.")),
]


MODEL_OPTIONS, CSV_OPTIONS = model_options()  # CSV_OPTIONS: tuples, written comma-separated
TRAIN_OPTIONS = [
    ("model", dict(help=model_help())),
    ("model_args", dict(multiple=True, default=(), help="key=value for your model's builder (repeat the flag; "
                        "values read as Python literals: 64, 0.1, True, 'text').")),
    *MODEL_OPTIONS,
    ("block_size", dict(type=int, help="Text: context length in tokens per sample.")),
    ("dataset", dict(help="Images: fashion-mnist, mnist, cifar10, cifar100, synthetic:CxHxW:K[:N]; text: fortunes, "
                     "synthetic-text[:N]; your own: tensors:FILE (.pt or .npz with inputs and labels), "
                     "imagefolder:DIR (a subfolder of PNG/JPEG images per class), text:PATH (a text file, documents "
                     "separated by blank lines, or a directory of text files), tokens:DIR (a corpus prepare-text "
                     "wrote, or nanoGPT's train.bin/val.bin with --vocab-size; memory-mapped), sft:FILE.jsonl (prompt/completion or chat messages records to "
                     "fine-tune on: the loss on the completions, the last replies).")),
    ("tokenizer", dict(help="Text: bytes (a token per byte) or bpe:N (a byte-level BPE of N tokens learned from the "
                       "training split; kept in OUT/tokenizer.json and in snapshots); for sft: records also hf:DIR "
                       "(a pretrained model's tokenizer.json).")),
    ("vocab_size", dict(type=int, default=None, help="Text: the model's vocabulary -- a corpus of bare token ids' "
                        "(nanoGPT's train.bin/val.bin say none), or more than the data's (e.g. 50304: GPT-2's 50257 "
                        "rounded up to a multiple of 64).")),
    ("data_dir", dict(help="Where the dataset is; the only place searched when given (default: $DISTLAB_DATA, "
                     "else /usr/share/datasets).")),
    ("data_on_device", dict(help="auto, on or off: keep the data set in GPU memory and gather each batch there "
                            "(auto: on a GPU run whose data takes at most 25% of the free GPU memory).")),
    ("epochs", dict(type=int, help="Passes over the training set (default: 1, or as many as --max-steps takes).")),
    ("max_steps", dict(type=int, help="Stop after this many optimizer steps (alone, it sets the run's length; with "
                       "--epochs, whichever ends first).")),
    ("global_batch_size", dict(type=int, aliases=("--batch-size",),
                               help="Samples per optimizer step over all ranks (split over the data-parallel ranks).")),
    ("lr", dict(type=float)),
    ("optimizer", dict(help="sgd, adam, adamw or muon (orthogonalised momentum for the weights of matrix "
                       "multiplications, AdamW for embeddings, the output layer, norms and biases).")),
    ("optimizer_state", dict(help="adam/adamw: the moments' dtype, fp32 or bf16 (4 bytes a parameter instead of 8; "
                                  "the float32 parameters kept).")),
    ("offload", dict(help="none, optimizer (the optimizer's state off the device: pinned host memory on a GPU, "
                     "each parameter stepped on the host; or a file, --offload-dir) or params (with --zero 3: the "
                     "parameter shards too, streamed in at each gather).")),
    ("offload_dir", dict(help="Where offloaded state goes: a memory-mapped file a rank in this directory (needed "
                         "on a CPU; on a GPU, ZeRO-Infinity's disk tier). Scratch, locked while a run holds it; "
                         "snapshots keep the state as always.")),
    ("offload_overlap", dict(is_flag=True, help="With --offload optimizer: each step's offloaded update on a thread "
                             "of its own, the next forward waiting layer by layer for the parameters it reads (the "
                             "same update, bit for bit; with ZeRO-3 too, not ZeRO-1/2 or Muon).")),
    ("lr_schedule", dict(help="constant, cosine or linear decay to 0.")),
    ("momentum", dict(type=float, help="SGD momentum.")),
    ("weight_decay", dict(type=float)),
    ("clip_grad_norm", dict(type=float, default=None, help="Scale each step's gradients so their global norm (the "
                            "whole model, every parameter counted once, on any layout) is at most this; the norm "
                            "before clipping is logged as grad_norm.")),
    ("seed", dict(type=int)),
    ("log_every", dict(type=int, help="Log the loss every N steps (rank 0).")),
    ("sample_every", dict(type=int, default=None, help="gpt: every N steps (and at the end) print a short text the "
                          "model generates, also kept in that step's metrics.jsonl record as 'sample'.")),
    ("label_smoothing", dict(type=float, help="Smooth the training loss's targets: 1 - S on the true class (or "
                             "token) plus S / classes on every class, as torch's cross_entropy (also across a "
                             "vocabulary split by tensor parallel); evaluations report the plain cross-entropy.")),
    ("peak_tflops", dict(type=float, default=None, help="A device's dense peak TFLOP/s at the run's precision, for "
                         "MFU (model FLOPs utilisation) beside tokens/s (default: a known GPU's data-sheet peak; "
                         "none on a CPU).")),
    ("eval_batch_size", dict(type=int, default=None, help="Samples each rank scores at a time in an evaluation "
                             "(default: a language model's training micro-batch, since its logits fill memory; "
                             "1000 for a classifier).")),
    ("eval_every", dict(type=int, default=None, help="Evaluate every N steps (and at the end) instead of every "
                        "epoch; the evaluation's numbers join that step's metrics.jsonl record.")),
    ("eval_batches", dict(type=int, default=None, help="Evaluate on the first N batches of --eval-batch-size "
                          "(default 1000) samples of the test (and validation) set only: a fixed subset, the same every time "
                          "(default: all of it).")),
    *STRATEGY_OPTIONS,
    ("lr_scaling", dict(help="Scale --lr with the global batch: none, linear (x G/B) or sqrt (x sqrt(G/B)), "
                        "B = --base-batch-size.")),
    ("base_batch_size", dict(type=int, help="The global batch size --lr was tuned for.")),
    ("warmup_steps", dict(type=int, help="Linear LR warm-up steps.")),
    ("val_fraction", dict(type=float, help="Hold out this fraction of the training set (seeded) for validation; the "
                          "best validation loss and its model go into snapshots.")),
    ("snapshot_dir", dict(help="Write snapshots here (every --snapshot-every steps and at the end).")),
    ("snapshot_every", dict(type=int, help="Snapshot every N optimizer steps.")),
    ("snapshot_async", dict(is_flag=True, help="Copy the state to host memory at the step and write the snapshot "
                            "in the background (the same files, checksums and atomic rename; at most one write in "
                            "flight): training stalls for the copy only.")),
    ("keep_snapshots", dict(type=int, help="Keep the newest K snapshots.")),
    ("trace", dict(default=None, help="A:B -- record every rank's timeline of optimizer steps A to B (data, "
                   "forward, backward, each bucket's all-reduce from issue to completion, the optimizer step) "
                   "into OUT/trace.json, Chrome's trace format: open it in Perfetto or chrome://tracing.")),
    ("profile", dict(default=None, help="A:B -- run torch.profiler over optimizer steps A to B: one kernel-level "
                     "trace per rank, OUT/profile/rank-N.json (Perfetto, chrome://tracing), distlab's own spans "
                     "(forward, bucket 3 all-reduce, ...) among torch's operators.")),
    ("resume", dict(help="auto (newest good snapshot in --snapshot-dir; also the default after torchrun restarts "
                    "the workers) or a snapshot directory.")),
    ("init_from", dict(help="Start from the weights in this whole-model state_dict file (distlab export writes "
                       "one; any torch.save(model.state_dict()) of the same model works), or hf:DIR, a Hugging "
                       "Face checkpoint (config.json + safetensors: Llama, Mistral), whose config gives the "
                       "model's options and vocabulary; a snapshot being resumed takes precedence.")),
    ("lora", dict(default=None, help="r=16,alpha=32,dropout=0.0,targets=q,k,v,o -- train low-rank adapters "
                  "(LoRA) on these layers and freeze the rest: no gradient, optimizer state or gradient sync for "
                  "the base. Targets as PEFT's target_modules (q_proj or q, k, v, o, gate, up, down; all: every "
                  "linear layer but the LM head); y = W x + B A x * alpha / r, B starting at zero.")),
    ("pack", dict(is_flag=True, help="sft: records packed into each window whole, as many as fit -- each attends "
                  "to itself only, its positions from 0 -- instead of one record per padded window.")),
    ("chat_turns", dict(type=click.Choice(["all", "last"]), help="sft: chats: every assistant reply is a target "
                        "(all: the system, user and tool turns are context, as TRL's assistant_only_loss trains), or "
                        "the last reply only.")),
    ("dpo_beta", dict(type=float, default=None, help="dpo:FILE.jsonl: DPO's beta, how far the trained model's "
                      "log-probability ratios to its starting model may go (default 0.1); the reference is the "
                      "starting model (with --lora: the base without adapters).")),
    ("reward", dict(default=None, help="rl:FILE.jsonl: the rewards a completion earns, comma-separated -- exact "
                    "(its answer is the record's \"answer\"), number (equal within 1e-6), format (<think>...</think>"
                    "<answer>...</answer>), regex:PATTERN, or your own FILE.py:NAME (NAME(completion, record) -> "
                    "float); default exact.")),
    ("reward_weights", dict(default=None, help="rl: one weight per --reward, comma-separated (default 1 each).")),
    ("group_size", dict(type=int, help="rl: completions sampled per prompt, compared with each other (GRPO's G).")),
    ("max_new_tokens", dict(type=int, default=None, help="rl: a completion's most tokens (default: to the "
                            "window's end).")),
    ("temperature", dict(type=float, help="rl: the sampling temperature of the rollouts.")),
    ("top_p", dict(type=float, help="rl: sample from the smallest set of tokens reaching this probability.")),
    ("ppo_epochs", dict(type=int, help="rl: optimizer steps each rollout batch trains (the ratio to the policy "
                        "that sampled it clipped to 1 +- --clip-epsilon).")),
    ("kl_beta", dict(type=float, help="rl: the weight of the KL penalty to the starting model (with --lora: the "
                     "base without adapters); 0 scores no reference.")),
    ("clip_epsilon", dict(type=float, help="rl: the importance ratio's clip below (and above, unless "
                          "--clip-epsilon-high).")),
    ("clip_epsilon_high", dict(type=float, default=None, help="rl: the ratio's clip above (DAPO's clip-higher).")),
    ("grpo_loss", dict(type=click.Choice(["grpo", "dapo", "dr_grpo"]), help="rl: the loss normalisation: grpo (per "
                       "completion, then over them), dapo (per token of the batch), dr_grpo (a constant: N x "
                       "--max-new-tokens).")),
    ("scale_rewards", dict(flag_pair=True, help="rl: divide each group's advantages by its rewards' std (default "
                           "on).")),
    ("base_dtype", dict(type=click.Choice(["float32", "bf16", "nf4"]), help="With --lora and --precision bf16: "
                        "hold (and under ZeRO-3 gather) the frozen base in bf16 -- or, nf4, each adapted layer's "
                        "weight in 4-bit NormalFloat (QLoRA; torchao's NF4 tensor; on every layout, split by tensor "
                        "parallel and sharded by ZeRO-3); the adapters and their optimizer state stay float32.")),
    ("lora_from", dict(default=None, help="peft:DIR -- start the adapters at those PEFT saved (adapter_config.json, "
                       "adapter_model.safetensors) for the --init-from hf:DIR base; its config gives --lora.")),
    ("time_budget_s", dict(default=None, help="Stop cleanly (evaluation, snapshot, summary) before this much "
                           "training time, counted across restarts: 2h, 90m, 3600s, 1h30m.")),
    ("out", dict(help="Run directory for metrics.jsonl and summary.json (default runs/MODEL-DATASET-TIME).")),
    ("tensorboard", dict(default=None, help="Also write TensorBoard event files here (loss, LR, throughput, "
                         "evaluations, each rank's memory; needs pip install tensorboard).")),
    ("progress", dict(flag_pair=True, default=None, help="Progress bar on rank 0 (default: when a terminal).")),
]
