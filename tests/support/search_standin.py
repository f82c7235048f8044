"""STAND-IN for Search-R1's retrieval server (slime examples/search-r1/local_dense_retriever/retrieval_server.py:
e5 embeddings + FAISS over wiki-18, ~132 GB, GPU), for the ported search-r1 example on CPU.

Serves the same interface on 127.0.0.1: `POST /retrieve` with `{"queries": [str], "topk": k, "return_scores":
false}` answers `{"result": [[doc, ...], ...]}`, one list per query, each doc `{"id": str, "contents":
"\\"<Title>\\"\\n<text>"}` — here the k documents of a small in-memory corpus sharing the most words with the query
(ties by corpus order). `GET /stats` counts the queries served, so a test can see the tool was used.

    python -m tests.support.search_standin --port 8000
"""

from __future__ import annotations

import argparse
import re

CORPUS = [
    ("Paris", "Paris is the capital and largest city of France."),
    ("Berlin", "Berlin is the capital of Germany."),
    ("Eiffel Tower", "The Eiffel Tower is a wrought-iron tower in Paris, built in 1889."),
    ("Mount Everest", "Mount Everest is the highest mountain above sea level, in the Himalayas."),
    ("Python", "Python is a programming language created by Guido van Rossum."),
    ("Moon", "The Moon is Earth's only natural satellite."),
]
_WORD = re.compile(r"[a-z0-9]+")


def retrieve(query: str, topk: int) -> list[dict[str, str]]:
    words = set(_WORD.findall(query.lower()))
    ranked = sorted(range(len(CORPUS)), key=lambda i: (-len(words & set(_WORD.findall(
        (CORPUS[i][0] + " " + CORPUS[i][1]).lower()))), i))
    return [{"id": str(i), "contents": f'"{CORPUS[i][0]}"\n{CORPUS[i][1]}'} for i in ranked[:max(topk, 0)]]


def app():  # -> Starlette
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    served = {"queries": 0}

    async def retrieve_route(request: Request) -> JSONResponse:
        body = await request.json()
        queries = body.get("queries")
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            return JSONResponse({"error": "queries must be a list of strings"}, status_code=400)
        served["queries"] += len(queries)
        return JSONResponse({"result": [retrieve(q, int(body.get("topk", 3))) for q in queries]})

    async def stats(request: Request) -> JSONResponse:
        return JSONResponse(served)

    return Starlette(routes=[Route("/retrieve", retrieve_route, methods=["POST"]), Route("/stats", stats)])


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    options = parser.parse_args()
    uvicorn.run(app(), host="127.0.0.1", port=options.port, log_level="warning")


if __name__ == "__main__":
    main()
