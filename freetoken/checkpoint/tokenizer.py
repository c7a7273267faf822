"""Tokenizers: a Hugging Face directory's own files, or one built from GGUF metadata.

Building a fast tokenizer from a GGUF vocabulary takes ``transformers`` ~30 s for 262k tokens,
so the result is saved once under the cache directory, keyed by the file's identity.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from freetoken import env
from freetoken.errors import CheckpointError

log = logging.getLogger(__name__)


def load_hf_tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"no usable tokenizer in {directory} ({e}); add tokenizer.json / tokenizer_config.json"
        ) from e


def load_gguf_tokenizer(path: Path) -> Any:
    """The file's tokenizer from its ``tokenizer.ggml.*`` metadata. ``AutoTokenizer`` also
    parses the architecture's config to pick a tokenizer class, which transformers cannot do
    for every file it can tokenise (Gemma-4's per-layer KV head counts, GPT-OSS's metadata);
    where it fails, the tokenizer is built from the vocabulary alone."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cached = env.cache_dir() / "tokenizers" / _file_key(path)
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    log.info("building the tokenizer from %s's metadata (once; cached in %s)", path.name, cached)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as auto:  # transformers raises many types for files it cannot map
        log.info("transformers' tokenizer class for %s: %s: %s; building it from the "
                 "vocabulary alone", path.name, type(auto).__name__, str(auto).splitlines()[0]
                 if str(auto) else "")
        fields = _tokenizer_fields(path)
        try:
            tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as vocab:
            # some transformers releases also parse the architecture's keys here (5.17 fails on
            # GPT-OSS's rope.scaling.*): read a copy of the file that holds the vocabulary only
            log.info("the vocabulary of %s with its architecture's keys: %s: %s; reading it "
                     "without them", path.name, type(vocab).__name__, vocab)
            tok = _from_vocabulary_copy(path, fields, cached.parent)
        _file_specials(tok, fields)
    try:
        tok.save_pretrained(str(cached))
    except OSError as e:
        log.warning("could not cache the tokenizer in %s: %s", cached, e)
    return tok


def _tokenizer_fields(path: Path) -> dict[str, Any]:
    """The file's ``general.architecture`` and ``tokenizer.*`` fields, as the gguf package
    reads them (with their value types, which a copy needs)."""
    import gguf

    try:
        fields = gguf.GGUFReader(str(path)).fields
    except Exception as e:  # the gguf package raises several types for a file it cannot read
        raise CheckpointError(f"cannot build a tokenizer from {path}: {e}") from e
    return {k: f for k, f in fields.items()
            if k.startswith("tokenizer.") or k == "general.architecture"}


def _from_vocabulary_copy(path: Path, fields: dict[str, Any], scratch: Path) -> Any:
    """The tokenizer of a GGUF copy of ``path`` that keeps only its ``tokenizer.*`` ``fields``
    (:func:`_tokenizer_fields`; no tensors, no architecture keys), so no architecture's
    metadata can stop transformers."""
    import tempfile

    import gguf
    from transformers import PreTrainedTokenizerFast

    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        copy = Path(tmp) / "vocabulary.gguf"
        try:
            model = fields.get("tokenizer.ggml.model")
            # a byte-level BPE vocabulary reads the same under any architecture; "gpt2" is one
            # every release converts (5.17 has no converter for "gpt-oss")
            arch = ("gpt2" if model is not None and model.contents() == "gpt2"
                    else str(fields["general.architecture"].contents()))
            writer = gguf.GGUFWriter(str(copy), arch)
            for key, field in fields.items():
                if key.startswith("tokenizer."):
                    sub = field.types[1] if len(field.types) > 1 else None
                    writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.close()
            return PreTrainedTokenizerFast.from_pretrained(tmp, gguf_file=copy.name)
        except Exception as e:
            raise CheckpointError(f"cannot build a tokenizer from {path}: {e}") from e


_SPECIALS = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id",
             "unk": "unknown_token_id"}


def _file_specials(tok: Any, fields: dict[str, Any]) -> None:
    """The file's own begin, end, padding and unknown tokens (its ``fields``) on a tokenizer
    built from its vocabulary alone (some transformers releases add their architecture's
    defaults instead, an end token outside the file's vocabulary among them)."""
    if "tokenizer.ggml.tokens" not in fields:
        return
    vocab = fields["tokenizer.ggml.tokens"].contents()
    for name, key in _SPECIALS.items():
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None and 0 <= (i := int(field.contents())) < len(vocab):
            setattr(tok, f"{name}_token", vocab[i])


def _file_key(path: Path) -> str:
    """Identity of a file without hashing all of it: name, size, and its first and last MiB."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:24]
