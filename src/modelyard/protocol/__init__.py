"""Wire formats shared by every HTTP edge (OpenAI, Open Inference Protocol, errors, SSE);
imports nothing of the platform."""
