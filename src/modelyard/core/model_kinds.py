"""What kind of model an endpoint serves, as clients see it, and which routes each kind answers.

A model is a `chat` model (an LLM with a chat template: chat, completions, Responses), a
`completion` model (an LLM without one: completions only), an `embedding` model
(`/v1/embeddings`, and the Open Inference Protocol) or a `classifier` (the Open Inference
Protocol). `refuse_wrong_kind` turns a request sent to a route its model does not answer into
one domain error, `WrongModelKind` (a 400 at the edge), that names the model's kind and the
route that serves it, instead of the worker's 404 for a route it does not have.
"""

from __future__ import annotations

from enum import StrEnum

from modelyard.core.errors import Invalid


class ModelKind(StrEnum):
    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"
    CLASSIFIER = "classifier"


# The gateway's request kinds (`Call.kind`) and the route each is sent to.
ROUTES: dict[str, str] = {
    "chat.completions": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "embeddings": "/v1/embeddings",
    "oip": "/v2/models/{model}/infer",
}

# The request kinds each model kind answers; the first is the route named in errors.
SERVES: dict[ModelKind, tuple[str, ...]] = {
    ModelKind.CHAT: ("chat.completions", "completions", "responses"),
    ModelKind.COMPLETION: ("completions",),
    ModelKind.EMBEDDING: ("embeddings", "oip"),
    ModelKind.CLASSIFIER: ("oip",),
}


class WrongModelKind(Invalid):
    """The request's route does not serve its model's kind (chat sent to an embedding model,
    embeddings asked of a chat model...)."""

    def __init__(self, model: str, kind: ModelKind, request_kind: str) -> None:
        route = ROUTES.get(request_kind, request_kind)
        right = " or ".join(ROUTES[k].replace("{model}", model) for k in SERVES[kind])
        article = "an" if kind[0] in "aeiou" else "a"
        super().__init__(
            f"The model `{model}` is {article} {kind} model, which {route} does not serve; "
            f"use {right}.",
            param="model",
            code="wrong_model_kind",
        )
        self.model_kind = kind
        self.right_routes = [ROUTES[k] for k in SERVES[kind]]


def refuse_wrong_kind(model: str, kind: str | None, request_kind: str) -> None:
    """Raise `WrongModelKind` when a model of `kind` does not answer `request_kind`; a model
    whose kind is not known yet (still provisioning) is let through."""
    if kind is None or request_kind not in ROUTES:
        return
    model_kind = ModelKind(kind)
    if request_kind not in SERVES[model_kind]:
        raise WrongModelKind(model, model_kind, request_kind)
