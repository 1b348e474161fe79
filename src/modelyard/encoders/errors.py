"""Typed failures of the encoder models and their host, free of any HTTP concern: the apps map
them onto their own protocol's errors."""

from __future__ import annotations


class EncoderError(Exception):
    """Base of every failure below."""


class EncoderInputError(EncoderError, ValueError):
    """One input cannot be encoded; `index` is its position in the list given to the model."""

    def __init__(self, index: int, detail: str) -> None:
        super().__init__(f"input {index} {detail}")
        self.index = index
        self.detail = detail

    def reindexed(self, index: int) -> EncoderInputError:
        """The same failure at `index` of the caller's own list (a batch has its own order)."""
        # Not copy.copy: it would call __init__ with `args`, which subclasses do not take.
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.index = index
        other.args = (f"input {index} {self.detail}",)
        return other


class InputTooLong(EncoderInputError):
    def __init__(self, index: int, n_tokens: int, limit: int) -> None:
        super().__init__(
            index,
            f"has {n_tokens} tokens, more than the model's limit of {limit} tokens "
            "(inputs are not truncated: shorten it)",
        )
        self.n_tokens = n_tokens
        self.limit = limit


class InputTooManyChars(EncoderInputError):
    """A text longer in characters than the model's token limit can hold, refused before it
    is tokenized (`modelyard.encoders.tokens.InputTokenizer.max_chars`)."""

    def __init__(self, index: int, n_chars: int, max_chars: int, limit: int) -> None:
        super().__init__(
            index,
            f"has {n_chars} characters, more than the {max_chars} that the model's limit of "
            f"{limit} tokens can hold (inputs are not truncated: shorten it)",
        )
        self.n_chars = n_chars
        self.max_chars = max_chars
        self.limit = limit


_OWN_TOKENIZER = (
    "token ids must come from this model's own tokenizer; send the text instead (LangChain's "
    "OpenAIEmbeddings sends OpenAI's token ids unless check_embedding_ctx_length=False)"
)


class InvalidTokenId(EncoderInputError):
    def __init__(self, index: int, token: int, vocab_size: int) -> None:
        super().__init__(
            index,
            f"holds token id {token}, outside the vocabulary [0, {vocab_size}): {_OWN_TOKENIZER}",
        )
        self.token = token
        self.vocab_size = vocab_size


class ForeignTokenId(InvalidTokenId):
    """A token id that the model's tokenizer never gives for text: a special or reserved
    (`[unused…]`) token. Seen in ids made by another tokenizer (OpenAI's small ids are common
    words and punctuation, which BERT vocabularies hold as reserved tokens)."""

    def __init__(self, index: int, token: int, piece: str, vocab_size: int) -> None:
        EncoderInputError.__init__(
            self,
            index,
            f"holds token id {token}, the model's reserved token {piece!r}, which its tokenizer "
            f"never gives for text: {_OWN_TOKENIZER}",
        )
        self.token = token
        self.vocab_size = vocab_size


class DimensionsNotSupported(EncoderError, ValueError):
    """`dimensions` asked of a model that was not trained for truncation, or out of range."""


class UnknownModel(EncoderError, LookupError):
    def __init__(self, name: str) -> None:
        super().__init__(f"The model '{name}' does not exist")
        self.name = name


class ModelTooLarge(EncoderError):
    """A model that would not fit the host's memory budget even alone."""


class HostBusy(EncoderError):
    """Loading a model needs memory that busy (non-evictable) models hold right now."""


class UnsupportedModel(EncoderError, ValueError):
    """A folder whose files this package cannot serve (pooling mode, missing files…)."""
