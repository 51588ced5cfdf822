//! Trains a Llama-style model from scratch, every attention call (forward and backward) through
//! flash-attn3.
//!
//! ```text
//! cargo run --release --example train                      # tiny preset, CPU, Python stdlib corpus
//! cargo run --release --features cuda --example train -- --preset 125m   # GPU, bf16
//! cargo run --release --example train -- --resume runs/train/checkpoint.safetensors
//! cargo run --release --features nccl --example train -- --preset 125m --data-parallel 8 --grad-accum 8
//! cargo run --release --features nccl --example train -- --preset 125m --context-parallel 2 --seq-len 131072 --batch-size 1
//! ```
//!
//! The corpus is the .py files of the local Python standard library (found through python3)
//! unless `--data FILE|DIR` says otherwise; tokens are bytes unless `--tokenizer DIR` names an
//! HF tokenizer.json. Checkpoints, the loss curve (PNG) and the final numbers go to `--out`.
//! docs/train.md describes the options and what the numbers mean.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device};
use clap::Parser;
use flash_llama::parallel::{launch, Communicator, Group, LocalGroup};
use flash_llama::train::{self, data, Corpus, Tokenization, TrainConfig, Trainer};
use flash_llama::{generate, Flow, GenerateOptions, SamplingParams, TextTokenizer};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Parser, Debug)]
#[command(about = "Train a Llama-style model from scratch (attention through flash-attn3)")]
struct Args {
    /// Model size and default settings: tiny (CPU, ~0.9M parameters) or 125m (GPU, bf16).
    #[arg(long, default_value = "tiny")]
    preset: String,

    /// A text file or a directory of them; default: the .py files of python3's standard library.
    #[arg(long)]
    data: Option<PathBuf>,

    /// File extensions read from a --data directory (comma-separated; empty: every file).
    #[arg(long, default_value = "py", value_delimiter = ',')]
    ext: Vec<String>,

    /// Read at most this many bytes of the corpus.
    #[arg(long)]
    max_bytes: Option<usize>,

    /// An HF model directory whose tokenizer.json to use instead of byte-level tokens.
    #[arg(long)]
    tokenizer: Option<PathBuf>,

    /// Optimizer updates in the whole run (the cosine schedule ends here).
    #[arg(long)]
    steps: Option<usize>,

    /// Sequences per micro-batch.
    #[arg(long)]
    batch_size: Option<usize>,

    /// Tokens per sequence.
    #[arg(long)]
    seq_len: Option<usize>,

    /// Micro-batches per update (gradient accumulation).
    #[arg(long)]
    grad_accum: Option<usize>,

    /// Peak learning rate (after warmup).
    #[arg(long)]
    lr: Option<f64>,

    /// Learning rate at the end of the cosine decay.
    #[arg(long)]
    min_lr: Option<f64>,

    /// Linear warmup steps.
    #[arg(long)]
    warmup: Option<usize>,

    /// AdamW weight decay (weight matrices only).
    #[arg(long)]
    weight_decay: Option<f64>,

    /// Clip the global gradient norm to this (0: no clipping).
    #[arg(long)]
    grad_clip: Option<f64>,

    /// Seed of the initial weights and of the batch order.
    #[arg(long)]
    seed: Option<u64>,

    /// Evaluate on the held-out split every N steps (default: 25 for tiny, 250 for 125m).
    #[arg(long)]
    eval_every: Option<usize>,

    /// Held-out micro-batches per evaluation.
    #[arg(long)]
    eval_batches: Option<usize>,

    /// Write a checkpoint every N steps (default: at every evaluation) and at the end.
    #[arg(long)]
    save_every: Option<usize>,

    /// Directory for checkpoint.safetensors and loss.png.
    #[arg(long, default_value = "runs/train")]
    out: PathBuf,

    /// Continue the run saved in this checkpoint (same data; its settings are used).
    #[arg(long)]
    resume: Option<PathBuf>,

    /// Stop (with a checkpoint) once this many steps are done, before --steps, e.g. to split a
    /// long run into sessions; the schedule still runs to --steps, and --resume continues it.
    #[arg(long)]
    until: Option<usize>,

    /// Compute dtype: f32 or bf16 (default: bf16 on the GPU, f32 on the CPU). The master
    /// weights and the optimizer are f32 either way.
    #[arg(long)]
    dtype: Option<String>,

    /// Run on the CPU even in a cuda build.
    #[arg(long)]
    cpu: bool,

    /// Data-parallel ranks: GPUs 0..N through NCCL (a build with `--features nccl`), or N
    /// threads on the CPU. Each step's micro-batches (--grad-accum, a multiple of N) are shared
    /// out, so a step is the same global batch as on one device.
    #[arg(long, default_value_t = 1)]
    data_parallel: usize,

    /// Context-parallel ranks: every sequence cut into N consecutive chunks, one per GPU (or CPU
    /// thread), attention as ring attention; for sequences too long for one device.
    /// --seq-len must be a multiple of N.
    #[arg(long, default_value_t = 1)]
    context_parallel: usize,

    /// Compute the gradients with `loss.backward()` through candle's autograd instead of the
    /// decoder's explicit backward (the default; docs/train.md, "The backward"). Slower; for
    /// comparing the two.
    #[arg(long)]
    autograd: bool,

    /// Activation checkpointing: keep only each layer's input through the forward and compute
    /// the rest again in the backward (about a third more compute, much less memory: longer
    /// --seq-len fits). Needs the explicit backward.
    #[arg(long)]
    checkpoint_activations: bool,

    /// Data-parallel: sum the gradients over the GPUs after the backward instead of starting
    /// each layer's sums as soon as its backward is done (the default, overlapped with the rest
    /// of the backward). The same sums; for comparing the two.
    #[arg(long)]
    no_overlap: bool,

    /// The device's peak TFLOP/s for the MFU figure (default on the GPU: 989, the dense bf16
    /// peak of H100 SXM and H200; H100 PCIe: 756). On the CPU no MFU is shown unless given.
    #[arg(long)]
    peak_tflops: Option<f64>,

    /// A .ttf/.otf font for the loss curve's text (default: DejaVu Sans, built in).
    #[arg(long)]
    font: Option<PathBuf>,

    /// Another run's training losses ("step,loss" lines, e.g. from scripts/train_baseline.py
    /// --losses-out), drawn into loss.png beside ours (labelled with the file's stem) and
    /// compared with ours at the end.
    #[arg(long)]
    reference_losses: Option<PathBuf>,

    /// At the end, sample up to this many tokens from the trained model after --prompt, within
    /// its training context (0: none).
    #[arg(long, default_value_t = 200)]
    sample: usize,

    /// The text the sample continues.
    #[arg(long, default_value = "class ")]
    prompt: String,

    /// Sampling temperature for the sample (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
}

fn main() {
    // Errors print as one chain of causes, without a backtrace.
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    let device = if args.cpu {
        Device::Cpu
    } else {
        Device::cuda_if_available(0)?
    };
    // Freed GPU memory stays in the device's pool across the step's synchronisations (the loss
    // read back to the host), so the next step's allocations need not map it again.
    flash_attn3::retain_freed_device_memory(&device)?;
    let world = match (args.data_parallel, args.context_parallel) {
        (0, _) | (_, 0) => bail!("--data-parallel and --context-parallel must be at least 1"),
        (d, c) if d > 1 && c > 1 => bail!("--data-parallel and --context-parallel cannot be combined (yet)"),
        (d, c) => d.max(c),
    };
    let context = args.context_parallel > 1;
    if world > 1 && device.is_cuda() {
        check_gpus(world)?;
        if launch::rank_from_env()?.is_none() {
            // The launcher: it only starts and watches the rank processes.
            return launch_gpu_ranks(world);
        }
    }
    let dtype = match (args.dtype.as_deref(), device.is_cuda()) {
        (Some("f32"), _) | (None, false) => DType::F32,
        (Some("bf16"), _) | (None, true) => DType::BF16,
        (Some(other), _) => bail!("unsupported --dtype {other}: use f32 or bf16"),
    };

    let tokenization = match &args.tokenizer {
        None => Tokenization::Bytes,
        Some(dir) => Tokenization::Hf(Box::new(
            TextTokenizer::from_hf_dir(dir, &[], None)
                .with_context(|| format!("loading the tokenizer in {}", dir.display()))?,
        )),
    };
    let t0 = Instant::now();
    let (data_path, skip_dirs) = match &args.data {
        Some(p) => (p.clone(), vec![]),
        // The stdlib directory also holds installed packages: keep to the standard library.
        None => (python_stdlib()?, vec!["site-packages", "dist-packages", "__pycache__"]),
    };
    let exts: Vec<String> = args.ext.iter().filter(|e| !e.is_empty()).cloned().collect();
    let files = data::list_files(&data_path, &exts, &skip_dirs)?;
    if files.is_empty() {
        bail!(
            "no {} files under {} (see --ext)",
            if exts.is_empty() { "".into() } else { exts.join("/") },
            data_path.display()
        )
    }
    let corpus = Corpus::from_files(&files, &tokenization, args.max_bytes)?;
    // Rank processes other than 0 print only their errors.
    let quiet = !launch::is_main_process();
    let held_out = if corpus.eval_docs > 0 {
        format!("every 20th of {} documents", corpus.train_docs + corpus.eval_docs)
    } else {
        format!("the last 5% of {} documents", corpus.train_docs)
    };
    if !quiet {
        eprintln!(
            "corpus: {} ({} files, {:.1} MB read) → {} training tokens, {} held-out ({held_out}); {}; read in {:.1}s",
            data_path.display(),
            files.len(),
            corpus.bytes as f64 / 1e6,
            corpus.train.len(),
            corpus.eval.len(),
            tokenization.describe(),
            t0.elapsed().as_secs_f64()
        );
    }

    if world == 1 {
        return train(&args, &corpus, &tokenization, dtype, device, None);
    }
    if device.is_cuda() {
        // A rank process started by launch_gpu_ranks: GPU `rank`, the group named in the env.
        let (rank, device, comm) = join_gpu_group(world)?;
        let parallel = match context {
            true => Parallel::Context(comm),
            false => Parallel::Data(Box::new(comm)),
        };
        return train(&args, &corpus, &tokenization, dtype, device, Some(parallel))
            .with_context(|| format!("rank {rank} of {world}"));
    }
    // On the CPU: one thread per rank, meeting in shared memory. A rank that fails ends the
    // process: the others would wait for it forever in their next collective.
    let groups = LocalGroup::new(world)?;
    std::thread::scope(|s| {
        for group in groups {
            let (args, corpus, tokenization) = (&args, &corpus, &tokenization);
            s.spawn(move || {
                let rank = group.rank();
                let parallel = match context {
                    true => Parallel::Context(std::sync::Arc::new(group)),
                    false => Parallel::Data(Box::new(group)),
                };
                if let Err(e) = train(args, corpus, tokenization, dtype, Device::Cpu, Some(parallel)) {
                    eprintln!("error (rank {rank} of {world}): {e:#}");
                    std::process::exit(1)
                }
            });
        }
    });
    Ok(())
}

/// The launcher of `--data-parallel N` on GPUs: one process per GPU
/// ([`flash_llama::parallel::launch`]).
#[cfg(feature = "nccl")]
fn launch_gpu_ranks(world: usize) -> Result<()> {
    launch::launch_gpu_ranks(world)
}

#[cfg(not(feature = "nccl"))]
fn launch_gpu_ranks(_: usize) -> Result<()> {
    unreachable!("check_gpus refuses GPU data parallelism without the nccl feature")
}

/// In a rank process: its rank, its GPU and its handle of the NCCL group.
#[cfg(feature = "nccl")]
fn join_gpu_group(world: usize) -> Result<(usize, Device, Group)> {
    let (rank, device, comm) = launch::join_gpu_group(world)?;
    flash_attn3::retain_freed_device_memory(&device)?;
    Ok((rank, device, std::sync::Arc::new(comm)))
}

#[cfg(not(feature = "nccl"))]
fn join_gpu_group(_: usize) -> Result<(usize, Device, Group)> {
    unreachable!("check_gpus refuses GPU data parallelism without the nccl feature")
}

/// GPU ranks (`--data-parallel N`, `--context-parallel N` on GPUs) need a build with NCCL.
fn check_gpus(world: usize) -> Result<()> {
    if !cfg!(feature = "nccl") {
        bail!("{world} GPU ranks need NCCL: build with `--features nccl` (or add --cpu for {world} CPU threads)")
    }
    // The launcher checks that the machine has `world` GPUs.
    Ok(())
}

/// How a rank shares the work with the others.
enum Parallel {
    /// Its share of each step's micro-batches (`--data-parallel`).
    Data(Box<dyn Communicator>),
    /// Its chunk of every sequence (`--context-parallel`).
    Context(Group),
}

impl Parallel {
    fn comm(&self) -> &dyn Communicator {
        match self {
            Parallel::Data(c) => c.as_ref(),
            Parallel::Context(g) => g.as_ref(),
        }
    }
}

/// The training run of one rank (`parallel`: its group; `None`: training alone).
/// Rank 0 prints, plots, checkpoints and samples; the other ranks only compute.
fn train(
    args: &Args,
    corpus: &Corpus,
    tokenization: &Tokenization,
    dtype: DType,
    device: Device,
    parallel: Option<Parallel>,
) -> Result<()> {
    let world = parallel.as_ref().map_or(1, |p| p.comm().world_size());
    let main_rank = parallel.as_ref().is_none_or(|p| p.comm().rank() == 0);
    let context = matches!(parallel, Some(Parallel::Context(_)));
    // Progress and results: printed by rank 0 only.
    macro_rules! say {
        ($($t:tt)*) => { if main_rank { eprintln!($($t)*) } };
    }
    let default_eval_every = if args.preset == "125m" { 250 } else { 25 };
    let eval_every = args.eval_every.unwrap_or(default_eval_every).max(1);
    let save_every = args.save_every.unwrap_or(eval_every).max(1);
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let checkpoint = args.out.join("checkpoint.safetensors");

    let mut trainer = match &args.resume {
        Some(path) => {
            reject_overrides(args)?;
            let t = Trainer::resume(path, corpus, dtype, &device)?;
            say!("resumed {} at step {}", path.display(), t.step());
            t
        }
        None => {
            let (mut model_cfg, cfg) = train::preset(&args.preset, tokenization.vocab_size())?;
            let cfg = apply_overrides(args, cfg);
            model_cfg.max_position_embeddings = model_cfg.max_position_embeddings.max(cfg.seq_len);
            Trainer::new(model_cfg, cfg, dtype, &device)?
        }
    };
    match parallel {
        Some(Parallel::Data(comm)) => trainer.set_data_parallel(comm)?,
        Some(Parallel::Context(group)) => trainer.set_context_parallel(group)?,
        None => {}
    }
    if args.autograd {
        trainer.set_backward(train::Backward::Autograd);
    }
    trainer.set_activation_checkpointing(args.checkpoint_activations);
    trainer.set_overlapped_gradient_sums(!args.no_overlap);
    let cfg = trainer.config().clone();
    let model_cfg = trainer.model_config().clone();
    let flops_per_token = train::flops_per_token(&model_cfg, cfg.seq_len)?;
    // MFU is against the peak of all the ranks' devices together.
    let peak_tflops = args
        .peak_tflops
        .or(device.is_cuda().then_some(989.0))
        .map(|p| p * world as f64);
    say!(
        "model: {} parameters ({} layers, hidden {}, {} heads / {} kv heads, vocab {}), {:?} compute on {:?}, {:?} backward; \
         {} tokens per step ({} × {} × {} accumulated), {:.1} MFLOP per token",
        trainer.num_parameters(),
        model_cfg.num_hidden_layers,
        model_cfg.hidden_size,
        model_cfg.num_attention_heads,
        model_cfg.num_key_value_heads,
        model_cfg.vocab_size,
        dtype,
        device.location(),
        trainer.backward(),
        cfg.tokens_per_step(),
        cfg.batch_size,
        cfg.seq_len,
        cfg.grad_accum,
        flops_per_token / 1e6
    );
    let ranks = if device.is_cuda() { "GPUs (NCCL)" } else { "CPU threads" };
    if world > 1 && context {
        say!(
            "context-parallel over {world} {ranks}: each holds {} of the {} tokens of every sequence (ring attention)",
            cfg.seq_len / world,
            cfg.seq_len
        );
    } else if world > 1 {
        say!(
            "data-parallel over {world} {ranks}: each computes {} of the {} micro-batches of a step",
            cfg.grad_accum / world,
            cfg.grad_accum
        );
    }

    if trainer.step() == 0 {
        let loss = trainer.evaluate(corpus)?;
        say!("step 0: eval loss {loss:.4}");
    }

    let bar = if main_rank {
        ProgressBar::new(cfg.steps as u64)
    } else {
        ProgressBar::hidden()
    }
    .with_position(trainer.step() as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg} (eta {eta})")?
            .progress_chars("=> "),
    );
    // Throughput over the steps of this process, eval and checkpoint time excluded, and the
    // first step too when there are others (it pays for allocations and kernel loading).
    let mut train_secs = 0f64;
    let mut train_tokens = 0usize;
    let mut first_step: Option<(f64, usize)> = None;
    let mut recent: Vec<(f64, usize)> = Vec::new();
    let mut last_eval = trainer.history().eval.last().map(|e| e.1);
    let stop = args.until.unwrap_or(cfg.steps).min(cfg.steps);
    while trainer.step() < stop {
        let t = Instant::now();
        let stats = trainer.train_step(corpus)?;
        let secs = t.elapsed().as_secs_f64();
        if first_step.is_none() {
            first_step = Some((secs, stats.tokens));
        } else {
            train_secs += secs;
            train_tokens += stats.tokens;
        }
        recent.push((secs, stats.tokens));
        if recent.len() > 10 {
            recent.remove(0);
        }
        let rate = recent.iter().map(|r| r.1).sum::<usize>() as f64 / recent.iter().map(|r| r.0).sum::<f64>();
        let mfu = peak_tflops
            .map(|p| format!(" | MFU {:.1}%", 100.0 * rate * flops_per_token / (p * 1e12)))
            .unwrap_or_default();
        let eval = last_eval.map(|l| format!(" eval {l:.3}")).unwrap_or_default();
        bar.set_message(format!(
            "loss {:.3}{eval} | {:.0} tok/s{mfu} | lr {:.1e}",
            stats.loss, rate, stats.lr
        ));
        bar.set_position(stats.step as u64);

        // Evaluating only on the run's own schedule (not at --until) keeps the history of a run
        // split into sessions identical to the uninterrupted run's.
        if stats.step % eval_every == 0 || stats.step == cfg.steps {
            let loss = trainer.evaluate(corpus)?;
            last_eval = Some(loss);
            // Also printed as a line, so that logs without a terminal show progress.
            bar.suspend(|| {
                say!(
                    "step {}/{}: train loss {:.4}, eval loss {loss:.4}, grad norm {:.3}, lr {:.2e}, {rate:.0} tokens/s{mfu}",
                    stats.step, cfg.steps, stats.loss, stats.grad_norm, stats.lr
                )
            });
        }
        if main_rank && (stats.step % save_every == 0 || stats.step == stop) {
            trainer.save(&checkpoint, corpus)?;
        }
    }
    bar.finish();
    if !main_rank {
        return Ok(());
    }

    let reference = match &args.reference_losses {
        Some(path) => Some(read_reference_losses(path)?),
        None => None,
    };
    let plot_path = args.out.join("loss.png");
    match plot_losses(&plot_path, trainer.history(), reference.as_ref(), args.font.as_deref()) {
        Ok(()) => eprintln!("loss curve: {}", plot_path.display()),
        Err(e) => eprintln!("warning: no loss curve: {e:#}"),
    }
    let h = trainer.history();
    if let Some(r) = &reference {
        eprintln!("{}", compare_losses(&h.train, r));
    }
    let tail = &h.train[h.train.len().saturating_sub(10)..];
    let tail_mean = tail.iter().map(|t| t.1 as f64).sum::<f64>() / tail.len().max(1) as f64;
    if train_tokens == 0 {
        // A single step: it is all there is to time.
        (train_secs, train_tokens) = first_step.unwrap_or((0.0, 0));
    }
    let rate = train_tokens as f64 / train_secs.max(1e-9);
    let mfu = peak_tflops
        .map(|p| format!(", MFU {:.1}%", 100.0 * rate * flops_per_token / (p * 1e12)))
        .unwrap_or_default();
    eprintln!(
        "done: step {}, train loss {:.4} (mean of the last {}), eval loss {}; {} tokens in {:.1}s of training steps (the first excluded): {:.0} tokens/s{mfu}; checkpoint {}",
        trainer.step(),
        tail_mean,
        tail.len(),
        h.eval.last().map(|e| format!("{:.4}", e.1)).unwrap_or("-".into()),
        train_tokens,
        train_secs,
        rate,
        checkpoint.display()
    );
    if args.sample > 0 {
        let text = sample(&trainer, tokenization, args)?;
        eprintln!("sample (temperature {}):", args.temperature);
        println!("{}{}", args.prompt, text);
    }
    Ok(())
}

/// `args.sample` tokens from the trained model after `args.prompt`, as text.
fn sample(trainer: &Trainer, tokenization: &Tokenization, args: &Args) -> Result<String> {
    let prompt = tokenization.encode(args.prompt.as_bytes())?;
    if prompt.is_empty() {
        bail!("--prompt must not be empty when sampling")
    }
    // The model has only seen windows of seq_len tokens: stay within them.
    let context = trainer.config().seq_len;
    if prompt.len() >= context {
        bail!("--prompt has {} tokens, the model's context is {context}", prompt.len())
    }
    let opts = GenerateOptions {
        max_tokens: args.sample.min(context - prompt.len()),
        sampling: SamplingParams {
            temperature: args.temperature,
            seed: 0,
            ..SamplingParams::default()
        },
        stop_tokens: tokenization.end_of_text().into_iter().collect(),
        kv_cache_dtype: None,
        cuda_graphs: true,
    };
    let out = generate(&trainer.inference_model()?, &[prompt], &opts, |_, _| Ok(Flow::Continue))?;
    tokenization.decode(&out.tokens[0])
}

/// The Python standard library directory, as python3 reports it.
fn python_stdlib() -> Result<PathBuf> {
    let out = Command::new("python3")
        .args(["-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"])
        .output()
        .map_err(|e| {
            anyhow!("python3 could not be run ({e}); the default corpus is the Python standard library: pass --data FILE|DIR instead")
        })?;
    if !out.status.success() {
        bail!(
            "python3 failed to report its standard library ({}); pass --data FILE|DIR instead",
            String::from_utf8_lossy(&out.stderr).trim()
        )
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !dir.is_dir() {
        bail!(
            "python3 reports its standard library at {}, which is not a directory; pass --data FILE|DIR instead",
            dir.display()
        )
    }
    Ok(dir)
}

fn apply_overrides(a: &Args, c: TrainConfig) -> TrainConfig {
    TrainConfig {
        batch_size: a.batch_size.unwrap_or(c.batch_size),
        seq_len: a.seq_len.unwrap_or(c.seq_len),
        grad_accum: a.grad_accum.unwrap_or(c.grad_accum),
        steps: a.steps.unwrap_or(c.steps),
        warmup_steps: a.warmup.unwrap_or(c.warmup_steps),
        lr: a.lr.unwrap_or(c.lr),
        min_lr: a.min_lr.unwrap_or(c.min_lr),
        weight_decay: a.weight_decay.unwrap_or(c.weight_decay),
        grad_clip: a.grad_clip.unwrap_or(c.grad_clip),
        eval_batches: a.eval_batches.unwrap_or(c.eval_batches),
        seed: a.seed.unwrap_or(c.seed),
        ..c
    }
}

/// A resumed run continues the saved one exactly, so its settings cannot change.
fn reject_overrides(a: &Args) -> Result<()> {
    let given: Vec<&str> = [
        ("--steps", a.steps.is_some()),
        ("--batch-size", a.batch_size.is_some()),
        ("--seq-len", a.seq_len.is_some()),
        ("--grad-accum", a.grad_accum.is_some()),
        ("--lr", a.lr.is_some()),
        ("--min-lr", a.min_lr.is_some()),
        ("--warmup", a.warmup.is_some()),
        ("--weight-decay", a.weight_decay.is_some()),
        ("--grad-clip", a.grad_clip.is_some()),
        ("--eval-batches", a.eval_batches.is_some()),
        ("--seed", a.seed.is_some()),
    ]
    .into_iter()
    .filter_map(|(name, set)| set.then_some(name))
    .collect();
    if !given.is_empty() {
        bail!(
            "--resume continues the saved run with the checkpoint's settings: drop {}",
            given.join(", ")
        )
    }
    Ok(())
}

/// The font the plot's text is drawn with when no --font is given: DejaVu Sans cut to ASCII
/// (examples/assets/README.md), built into the binary, so the labels never depend on the
/// machine's fonts.
static BUNDLED_FONT: &[u8] = include_bytes!("assets/DejaVuSans-ascii.ttf");

/// The font for the plot's text: `explicit`, else the bundled one.
fn font_bytes(explicit: Option<&Path>) -> Result<&'static [u8]> {
    match explicit {
        // plotters keeps registered fonts for the whole process, hence 'static.
        Some(p) => Ok(Box::leak(
            std::fs::read(p)
                .with_context(|| format!("reading the font {}", p.display()))?
                .into_boxed_slice(),
        )),
        None => Ok(BUNDLED_FONT),
    }
}

/// Another run's training losses by step, and the name it is shown under.
struct ReferenceLosses {
    label: String,
    losses: Vec<(usize, f32)>,
}

/// Reads "step,loss" lines (a header line and blank lines are skipped).
fn read_reference_losses(path: &Path) -> Result<ReferenceLosses> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut losses = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || (i == 0 && line.starts_with("step")) {
            continue;
        }
        let parsed = line
            .split_once(',')
            .and_then(|(s, l)| Some((s.trim().parse::<usize>().ok()?, l.trim().parse::<f32>().ok()?)));
        match parsed {
            Some(p) => losses.push(p),
            None => bail!(
                "{} line {}: expected \"step,loss\", got {line:?}",
                path.display(),
                i + 1
            ),
        }
    }
    if losses.is_empty() {
        bail!("{}: no \"step,loss\" lines", path.display())
    }
    let label = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "reference".into());
    Ok(ReferenceLosses { label, losses })
}

/// One line comparing our training losses with the reference's at the steps both have: the
/// mean absolute difference over all of them and over the last tenth, next to the two means.
fn compare_losses(ours: &[(usize, f32)], reference: &ReferenceLosses) -> String {
    let theirs: std::collections::HashMap<usize, f32> = reference.losses.iter().copied().collect();
    let pairs: Vec<(f32, f32)> = ours
        .iter()
        .filter_map(|&(s, l)| theirs.get(&s).map(|&r| (l, r)))
        .collect();
    if pairs.is_empty() {
        return format!("reference {}: no step in common with this run", reference.label);
    }
    let stats = |p: &[(f32, f32)]| {
        let n = p.len() as f64;
        let mean = |f: &dyn Fn(&(f32, f32)) -> f64| p.iter().map(f).sum::<f64>() / n;
        (
            mean(&|x| x.0 as f64),
            mean(&|x| x.1 as f64),
            mean(&|x| (x.0 - x.1).abs() as f64),
        )
    };
    let (o, r, d) = stats(&pairs);
    let tail = &pairs[pairs.len() - pairs.len().div_ceil(10)..];
    let (to, tr, td) = stats(tail);
    format!(
        "reference {}: {} steps in common; mean loss ours {o:.4}, {} {r:.4}, mean |difference| {d:.4}; \
         last {} steps: ours {to:.4}, {} {tr:.4}, mean |difference| {td:.4}",
        reference.label,
        pairs.len(),
        reference.label,
        tail.len(),
        reference.label
    )
}

/// Draws the train and eval losses against the step into a PNG, with its title, axis labels and
/// legend in `font` (or the bundled font; plotters' pure-Rust ab_glyph renderer, so no
/// fontconfig/freetype at build or run time); and a reference run's training losses if given.
fn plot_losses(
    path: &Path,
    history: &train::History,
    reference: Option<&ReferenceLosses>,
    font: Option<&Path>,
) -> Result<()> {
    use plotters::prelude::*;

    plotters::style::register_font("sans-serif", FontStyle::Normal, font_bytes(font)?)
        .map_err(|_| anyhow!("the font file is not a usable TrueType/OpenType font"))?;
    let reference_points = reference.map(|r| r.losses.as_slice()).unwrap_or_default();
    let all = history.train.iter().chain(&history.eval).chain(reference_points);
    let max_step = all.clone().map(|p| p.0).max().unwrap_or(1).max(1);
    let (lo, hi) = all.fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    if !lo.is_finite() {
        bail!("no losses to plot")
    }
    let margin = ((hi - lo) * 0.05).max(1e-3);
    let (lo, hi) = ((lo - margin).max(0.0), hi + margin);

    let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .margin(20)
        .caption("flash-llama training loss", ("sans-serif", 26))
        .x_label_area_size(45)
        .y_label_area_size(60);
    let mut chart = builder.build_cartesian_2d(0f32..max_step as f32, lo..hi)?;
    let mut mesh = chart.configure_mesh();
    mesh.x_desc("step").y_desc("cross-entropy (nats/token)");
    // Whole steps only: at most one tick per step.
    mesh.x_labels((max_step + 1).min(10));
    mesh.x_label_formatter(&|x| format!("{x:.0}"));
    mesh.draw()?;

    let train_color = RGBColor(70, 130, 220);
    chart
        .draw_series(LineSeries::new(
            history.train.iter().map(|&(s, l)| (s as f32, l)),
            train_color.stroke_width(1),
        ))?
        .label(if reference.is_some() { "train (ours)" } else { "train" })
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], train_color.stroke_width(2)));
    if let Some(r) = reference {
        let color = RGBColor(240, 140, 20);
        chart
            .draw_series(LineSeries::new(
                r.losses.iter().map(|&(s, l)| (s as f32, l)),
                color.stroke_width(1),
            ))?
            .label(format!("train ({})", r.label))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .draw_series(LineSeries::new(
            history.eval.iter().map(|&(s, l)| (s as f32, l)),
            RED.stroke_width(2),
        ))?
        .label("eval (held-out)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
    chart.draw_series(
        history
            .eval
            .iter()
            .map(|&(s, l)| Circle::new((s as f32, l), 3, RED.filled())),
    )?;
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
