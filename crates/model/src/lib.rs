//! Llama-family models (in progress).
