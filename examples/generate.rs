//! Text generation with a Llama-family model whose attention runs through flash-attn3.
//!
//! ```text
//! scripts/fetch-default-model.sh     # SmolLM2-135M-Instruct (GGUF) into models/
//! cargo run --release --example generate -- --chat --prompt "What is the capital of France?"
//! ```
//!
//! `--model` takes a `.gguf` file or an HF directory (config.json, safetensors, tokenizer.json).
//! Several `--prompt`s are generated together as one batch. `--token-ids 1,2,3` takes a prompt
//! as token ids (no tokenizer) and `--dump-logits FILE` writes every step's logits as .npy:
//! what `scripts/gpu_model_check.py` compares with HF transformers. `--kv-cache-dtype fp8` keeps
//! the KV cache in e4m3; `--perplexity FILE` prints a text's perplexity through the cache.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::Parser;
use flash_llama::{
    generate, ChatMessage, Flow, GenerateOptions, Kernels, Llama, SamplingParams, TextTokenizer, TokenStream,
};

mod common;

#[derive(Parser, Debug)]
#[command(about = "Generate text with a Llama-family model (attention through flash-attn3)")]
struct Args {
    /// A .gguf file or an HF model directory.
    #[arg(long, default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,

    /// An HF directory whose tokenizer.json (and tokenizer_config.json) to use instead of the
    /// model's own, e.g. for GGUF files with a SentencePiece vocabulary (Llama 2, Mistral).
    #[arg(long)]
    tokenizer: Option<PathBuf>,

    /// The prompt; repeat the flag to generate for several prompts in one batch.
    #[arg(long, required_unless_present_any = ["token_ids", "perplexity"], conflicts_with = "token_ids")]
    prompt: Vec<String>,

    /// The KV cache's dtype: `model` (the compute dtype) or `fp8` (e4m3 with a scale per layer
    /// and kv head, half the bytes of bf16, read directly by the decode attention).
    #[arg(long, default_value = "model", value_parser = ["model", "fp8"])]
    kv_cache_dtype: String,

    /// Instead of generating, print the perplexity of the text in this file, computed token by
    /// token through the KV cache (every prediction after the first reads the cache, so
    /// --kv-cache-dtype shows in it). --max-tokens does not apply; the text is cut to the
    /// model's context.
    #[arg(long, conflicts_with_all = ["prompt", "token_ids", "dump_logits", "chat"])]
    perplexity: Option<PathBuf>,

    /// A prompt given as comma-separated token ids instead of text, or `@FILE` to read them from
    /// a file (repeat for a batch). No
    /// tokenizer is loaded: the generated ids are printed, one line per prompt. For checks and
    /// benchmarks with random-weight models.
    #[arg(long)]
    token_ids: Vec<String>,

    /// Write the logits of every generation step, greedy, as an f32 .npy array of shape
    /// (steps, batch, vocab): step 0 follows the prompt, step i the i-th generated token.
    /// Needs --temperature 0; with --token-ids.
    #[arg(long, requires = "token_ids")]
    dump_logits: Option<PathBuf>,

    /// With --dump-logits: recompute every step without the cache through the textbook
    /// attention composite instead of flash-attn3 (`Llama::forward_reference`), to tell the
    /// op's errors from the rest of the model's.
    #[arg(long, hide = true, requires = "dump_logits")]
    reference_attention: bool,

    /// Generate exactly --max-tokens tokens, ignoring the stop tokens (benchmarks).
    #[arg(long)]
    ignore_eos: bool,

    /// Run the same generation once before the measured one (CUDA context, cuBLAS handles and
    /// kernels loaded), so that the printed tokens/s are steady-state numbers.
    #[arg(long)]
    warmup: bool,

    /// Decode step by step with eager launches instead of replaying a CUDA graph of the step
    /// (decoding on the GPU with the model-dtype cache and no repeat penalty captures one by
    /// default).
    #[arg(long)]
    no_cuda_graphs: bool,

    /// Wrap each prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,

    /// Tokens to generate per prompt at most.
    #[arg(short = 'n', long, default_value_t = 128)]
    max_tokens: usize,

    /// Sampling temperature; 0 is greedy decoding.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,

    /// Sample among the k most likely tokens only (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,

    /// Sample among the most likely tokens whose probabilities add up to p (1: all).
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,

    /// Penalty on tokens seen in the last --repeat-last-n tokens (1: none).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,

    /// How many of the latest tokens the repeat penalty looks at.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,

    /// Sampling seed; prompt i of a batch uses seed + i.
    #[arg(long, default_value_t = 299792458)]
    seed: u64,

    /// Compute dtype: f32, bf16 or f16 (GGUF weights are dequantised to it). Default: bf16 on
    /// the GPU (flash-attn3's kernels take bf16/f16 only), f32 on the CPU.
    #[arg(long)]
    dtype: Option<String>,

    /// Run on the CPU even when a GPU is available.
    #[arg(long)]
    cpu: bool,

    /// Tensor parallelism: split the model's heads and MLP over GPUs 0..N, one process each,
    /// summing through NCCL (a build with `--features nccl`); for models too big for one GPU.
    /// Every rank computes the same logits; rank 0 prints.
    #[arg(long, default_value_t = 1)]
    tp: usize,

    /// Run the trainable form: RMSNorm and RoPE as compositions of candle ops and separate
    /// q/k/v and gate/up matmuls, instead of the inference form (candle-nn's fused forward-only
    /// kernels, weights concatenated at load), which is faster.
    #[arg(long)]
    composed: bool,
}

fn main() {
    // Errors print as one chain of causes ("loading X: ... : ..."), without a backtrace.
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    let (device, group) = match args.tp {
        0 => bail!("--tp must be at least 1"),
        1 => (common::device(args.cpu)?, None),
        _ if args.cpu => bail!("--tp splits the model over GPUs; on the CPU drop --tp"),
        world => match common::tensor_parallel_rank(world)? {
            // This process was the launcher: the ranks have run and finished.
            None => return Ok(()),
            Some((device, group)) => (device, Some(group)),
        },
    };
    // Rank processes other than 0 print only their errors.
    let main_process = flash_llama::parallel::launch::is_main_process();
    macro_rules! note {
        ($($t:tt)*) => { if main_process { eprintln!($($t)*) } };
    }
    let dtype = common::inference_dtype(args.dtype.as_deref(), &device)?;
    let kernels = if args.composed {
        Kernels::Composed
    } else {
        Kernels::Fused
    };
    let ids_mode = !args.token_ids.is_empty();
    if args.dump_logits.is_some() && args.temperature != 0.0 {
        bail!("--dump-logits needs greedy decoding (--temperature 0)")
    }

    let t0 = std::time::Instant::now();
    // The whole model, or with --tp this rank's shard of it.
    let load_model = || match &group {
        None => flash_llama::loader::load_model(&args.model, dtype, &device, kernels),
        Some(g) => flash_llama::loader::load_model_tensor_parallel(&args.model, dtype, &device, kernels, g.clone()),
    };
    let loaded = if ids_mode {
        // Token ids in, token ids out: the model alone, no tokenizer needed.
        load_model().map(|model| (model, None))
    } else {
        match &args.tokenizer {
            None => match &group {
                None => flash_llama::load(&args.model, dtype, &device, kernels),
                Some(g) => flash_llama::loader::load_tensor_parallel(&args.model, dtype, &device, kernels, g.clone()),
            }
            .map(|l| (l.model, Some(l.tokenizer))),
            Some(dir) => load_model().and_then(|model| {
                let cfg = model.config();
                let tokenizer = TextTokenizer::from_hf_dir(dir, &cfg.eos_token_ids, cfg.bos_token_id)?;
                Ok((model, Some(tokenizer)))
            }),
        }
    }
    .with_context(|| format!("loading {}", args.model.display()))?;
    let (model, tokenizer) = (&loaded.0, loaded.1.as_ref());
    let cfg = model.config();
    note!(
        "loaded {} ({:?}, {} layers, hidden {}, {} heads / {} kv heads) in {:.1}s on {:?} as {dtype:?}",
        args.model.display(),
        cfg.architecture,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        t0.elapsed().as_secs_f64(),
        device.location(),
    );

    let kv_cache_dtype = common::kv_cache_dtype(&args.kv_cache_dtype, model.dtype())?;

    if let Some(path) = &args.perplexity {
        let Some(tokenizer) = tokenizer else {
            bail!("--perplexity needs the model's tokenizer")
        };
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut tokens = tokenizer.encode(&text, true)?;
        tokens.truncate(cfg.max_position_embeddings);
        let ppl = flash_llama::perplexity(model, &tokens, kv_cache_dtype)?;
        println!(
            "perplexity {:.4} (mean NLL {:.5} nats) over {} predicted tokens of {}, KV cache {kv_cache_dtype:?}, {:.1} tokens/s",
            ppl.value(),
            ppl.mean_nll,
            ppl.predicted,
            path.display(),
            ppl.tokens_per_sec()
        );
        return Ok(());
    }

    let prompts: Vec<Vec<u32>> = match tokenizer {
        None => args
            .token_ids
            .iter()
            .map(|arg| {
                // `@FILE`: the ids in a file (prompts too long for a command line).
                let list = match arg.strip_prefix('@') {
                    Some(path) => {
                        std::fs::read_to_string(path).with_context(|| format!("reading --token-ids {arg}"))?
                    }
                    None => arg.clone(),
                };
                list.trim()
                    .split(',')
                    .map(|t| t.trim().parse::<u32>())
                    .collect::<std::result::Result<Vec<u32>, _>>()
                    .with_context(|| format!("--token-ids {arg:?}: expected comma-separated token ids"))
            })
            .collect::<Result<_>>()?,
        Some(tokenizer) => args
            .prompt
            .iter()
            .map(|p| {
                if args.chat {
                    let text = tokenizer.apply_chat_template(&[ChatMessage::user(p.clone())])?;
                    tokenizer.encode(&text, false)
                } else {
                    tokenizer.encode(p, true)
                }
            })
            .collect::<Result<_>>()?,
    };

    if let Some(path) = &args.dump_logits {
        let (tokens, steps) = greedy_with_logits(
            model,
            &prompts,
            args.max_tokens,
            args.reference_attention,
            kv_cache_dtype,
        )?;
        for t in &tokens {
            println!("{}", join_ids(t));
        }
        // Tensor-parallel ranks hold the same logits: rank 0 writes them.
        if main_process {
            write_npy_f32(path, &[steps.len(), prompts.len(), cfg.vocab_size], &steps.concat())?;
        }
        note!("wrote the logits of {} steps to {}", steps.len(), path.display());
        return Ok(());
    }

    let opts = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            repeat_penalty: args.repeat_penalty,
            repeat_last_n: args.repeat_last_n,
            seed: args.seed,
        },
        stop_tokens: match (args.ignore_eos, tokenizer) {
            (true, _) => Vec::new(),
            (false, Some(t)) => t.eos_token_ids.clone(),
            (false, None) => cfg.eos_token_ids.clone(),
        },
        kv_cache_dtype: Some(kv_cache_dtype),
        // Tensor-parallel steps are captured with their NCCL all-reduces (NCCL supports stream
        // capture), like any other step.
        cuda_graphs: !args.no_cuda_graphs,
    };
    if args.warmup {
        let t = std::time::Instant::now();
        generate(model, &prompts, &opts, |_, _| Ok(Flow::Continue))?;
        note!("warm-up generation: {:.2}s", t.elapsed().as_secs_f64());
    }

    // One text prompt streams its text as it is produced; a batch prints each answer at the end.
    let stream_text = match tokenizer {
        Some(t) if prompts.len() == 1 => {
            print!("{}", args.prompt[0]);
            if args.chat {
                println!();
            }
            std::io::stdout().flush()?;
            Some(TokenStream::new(t))
        }
        _ => None,
    };
    let mut stream = stream_text;
    let generation = generate(model, &prompts, &opts, |_, token| {
        if let Some(stream) = stream.as_mut() {
            let text = stream
                .push(token)
                .map_err(|e| candle_core::Error::msg(format!("{e:#}")))?;
            if let Some(text) = text {
                print!("{text}");
                std::io::stdout().flush()?;
            }
        }
        Ok(Flow::Continue)
    })?;
    match (stream, tokenizer) {
        (Some(mut stream), _) => {
            if let Some(rest) = stream.finish()? {
                print!("{rest}");
            }
            println!();
        }
        (None, Some(tokenizer)) => {
            for (i, (prompt, tokens)) in args.prompt.iter().zip(&generation.tokens).enumerate() {
                println!("--- [{i}] {prompt}\n{}", tokenizer.decode(tokens)?);
            }
        }
        (None, None) => {
            for tokens in &generation.tokens {
                println!("{}", join_ids(tokens));
            }
        }
    }
    note!(
        "\nprompt: {} tokens in {:.2}s ({:.1} tokens/s); generation: {} tokens in {:.2}s ({:.1} tokens/s)",
        generation.prompt_tokens,
        generation.prefill_secs,
        generation.prefill_tokens_per_sec(),
        generation.decode_tokens,
        generation.decode_secs,
        generation.decode_tokens_per_sec(),
    );
    if device.is_cuda() && generation.decode_secs > 0.0 {
        note!(
            "generation: {:.0}% of the time waiting for the device (less: the host's own work per step is the limit)",
            100.0 * generation.decode_wait_secs / generation.decode_secs
        );
    }
    if let (Some(p50), Some(p99)) = (
        generation.inter_token_latency(0.5),
        generation.inter_token_latency(0.99),
    ) {
        note!("inter-token latency: p50 {:.2} ms, p99 {:.2} ms", 1e3 * p50, 1e3 * p99);
    }
    Ok(())
}

fn join_ids(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// One generation step's logits, (batch × vocab) row-major.
type StepLogits = Vec<f32>;

/// Greedy generation of exactly `n` tokens per prompt (stop tokens ignored) through the cache,
/// keeping each step's logits: returns the tokens per prompt and, per step, the (batch × vocab)
/// f32 logits row-major.
/// `reference`: each step recomputes every sequence from scratch with the attention composite.
fn greedy_with_logits(
    model: &Llama,
    prompts: &[Vec<u32>],
    n: usize,
    reference: bool,
    kv_cache_dtype: DType,
) -> Result<(Vec<Vec<u32>>, Vec<StepLogits>)> {
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut cache = model.new_cache_of(prompts.len(), longest + n.max(1), kv_cache_dtype)?;
    let mut inputs = prompts.to_vec();
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut steps = Vec::new();
    for _ in 0..n {
        let rows: Vec<Vec<f32>> = if reference {
            let mut rows = Vec::new();
            for (prompt, generated) in prompts.iter().zip(&tokens) {
                let seq: Vec<u32> = prompt.iter().chain(generated).copied().collect();
                let len = seq.len();
                let ids = candle_core::Tensor::new(seq, model.device())?.unsqueeze(0)?;
                let logits = model.forward_reference(&ids)?.get(0)?.get(len - 1)?;
                rows.push(logits.to_device(&Device::Cpu)?.to_vec1()?);
            }
            rows
        } else {
            model.step(&inputs, &mut cache)?.to_device(&Device::Cpu)?.to_vec2()?
        };
        for (i, row) in rows.iter().enumerate() {
            let best = row.iter().enumerate().fold(
                (0, f32::NEG_INFINITY),
                |acc, (j, &x)| if x > acc.1 { (j, x) } else { acc },
            );
            tokens[i].push(best.0 as u32);
            inputs[i] = vec![best.0 as u32];
        }
        steps.push(rows.concat());
    }
    Ok((tokens, steps))
}

/// Writes `data` as a little-endian f32 NumPy .npy file (format 1.0) of the given shape.
fn write_npy_f32(path: &std::path::Path, shape: &[usize], data: &[f32]) -> Result<()> {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    let shape_text = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_text}, }}");
    // Magic (6) + version (2) + length (2) + header, padded with spaces to a multiple of 64,
    // ending in a newline.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + 4 * data.len());
    bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for x in data {
        bytes.extend_from_slice(&x.to_le_bytes());
    }
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}
