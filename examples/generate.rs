//! Text generation with a Llama-family model whose attention runs through flash-attn3.
//!
//! ```text
//! scripts/fetch-default-model.sh     # SmolLM2-135M-Instruct (GGUF) into models/
//! cargo run --release --example generate -- --chat --prompt "What is the capital of France?"
//! ```
//!
//! `--model` takes a `.gguf` file or an HF directory (config.json, safetensors, tokenizer.json).
//! Several `--prompt`s are generated together as one batch.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::Parser;
use flash_llama::{
    generate, ChatMessage, GenerateOptions, Kernels, LoadedModel, SamplingParams, TextTokenizer, TokenStream,
};

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
    #[arg(long, required = true)]
    prompt: Vec<String>,

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

    /// Compute dtype: f32, bf16 or f16 (GGUF weights are dequantised to it).
    #[arg(long, default_value = "f32")]
    dtype: String,

    /// Run on the CPU even when a GPU is available.
    #[arg(long)]
    cpu: bool,

    /// Run RMSNorm and RoPE as compositions of candle ops (the differentiable path used for
    /// training) instead of candle-nn's fused forward-only kernels, which are faster.
    #[arg(long)]
    composed: bool,
}

fn device(cpu: bool) -> Result<Device> {
    if cpu {
        return Ok(Device::Cpu);
    }
    // Device::cuda_if_available is the CPU unless built with the cuda feature and a GPU exists.
    Ok(Device::cuda_if_available(0)?)
}

fn main() {
    // Errors print as one chain of causes ("loading X: ... : ..."), without a backtrace.
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    let dtype = match args.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => bail!("unsupported --dtype {other}: use f32, bf16 or f16"),
    };
    let device = device(args.cpu)?;
    let kernels = if args.composed {
        Kernels::Composed
    } else {
        Kernels::Fused
    };

    let t0 = std::time::Instant::now();
    let loaded = match &args.tokenizer {
        None => flash_llama::load(&args.model, dtype, &device, kernels),
        Some(dir) => flash_llama::loader::load_model(&args.model, dtype, &device, kernels).and_then(|model| {
            let cfg = model.config();
            let tokenizer = TextTokenizer::from_hf_dir(dir, &cfg.eos_token_ids, cfg.bos_token_id)?;
            Ok(LoadedModel { model, tokenizer })
        }),
    }
    .with_context(|| format!("loading {}", args.model.display()))?;
    let (model, tokenizer) = (&loaded.model, &loaded.tokenizer);
    let cfg = model.config();
    eprintln!(
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

    let prompts: Vec<Vec<u32>> = args
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
        .collect::<Result<_>>()?;

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
        stop_tokens: tokenizer.eos_token_ids.clone(),
    };

    // One prompt streams its text as it is produced; a batch prints each answer at the end.
    let single = prompts.len() == 1;
    if single {
        print!("{}", args.prompt[0]);
        if args.chat {
            println!();
        }
        std::io::stdout().flush()?;
    }
    let mut stream = TokenStream::new(tokenizer);
    let generation = generate(model, &prompts, &opts, |_, token| {
        if single {
            let text = stream
                .push(token)
                .map_err(|e| candle_core::Error::msg(format!("{e:#}")))?;
            if let Some(text) = text {
                print!("{text}");
                std::io::stdout().flush()?;
            }
        }
        Ok(())
    })?;
    if single {
        if let Some(rest) = stream.finish()? {
            print!("{rest}");
        }
        println!();
    } else {
        for (i, (prompt, tokens)) in args.prompt.iter().zip(&generation.tokens).enumerate() {
            println!("--- [{i}] {prompt}\n{}", tokenizer.decode(tokens)?);
        }
    }
    eprintln!(
        "\nprompt: {} tokens in {:.2}s ({:.1} tokens/s); generation: {} tokens in {:.2}s ({:.1} tokens/s)",
        generation.prompt_tokens,
        generation.prefill_secs,
        generation.prefill_tokens_per_sec(),
        generation.decode_tokens,
        generation.decode_secs,
        generation.decode_tokens_per_sec(),
    );
    Ok(())
}
