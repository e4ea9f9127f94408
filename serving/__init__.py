"""Stage 4: a trained draft into real serving engines: export to the folders vLLM / SGLang /
transformers load, validation inside real vLLM, publishing to the Hugging Face Hub."""
