"""A fake OpenAI-compatible server with known chunks, delays and usage, for tests/test_bench.py.

    python tests/fake_openai_server.py PORT

Each streamed answer: an empty role chunk at once, the first content chunk
FIRST_DELAY seconds after the request arrived, the others GAP apart, a finish
chunk, then a usage chunk whose completion_tokens (USAGE_OUT) is deliberately
not the number of content chunks. GET /_test/log returns the request bodies and
their arrival times (time.perf_counter); POST /_test/reset {"fail_every": k}
clears them and answers 500 to every k-th request from then on.
"""


import asyncio
import json
import sys
import time

FIRST_DELAY = 0.050
GAP = 0.020
CHUNKS = ["Hello", " there", ",", " friend", "!"]
USAGE_OUT = 7  # not len(CHUNKS): a bench that counted chunks would be caught
USAGE_IN = 11


def create_app():
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    state = {"bodies": [], "arrivals": [], "fail_every": None, "in_flight": 0, "overlaps": []}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/_test/log")
    async def log():
        return {"bodies": state["bodies"], "arrivals": state["arrivals"], "overlaps": state["overlaps"]}

    @app.post("/_test/reset")
    async def reset(request: Request):
        state["bodies"], state["arrivals"], state["overlaps"] = [], [], []
        state["fail_every"] = (await request.json()).get("fail_every")
        return {"ok": True}

    async def answer(request: Request, chat: bool):
        arrived = time.perf_counter()
        body = await request.json()
        state["bodies"].append(body)
        state["arrivals"].append(arrived)
        state["overlaps"].append(state["in_flight"])  # requests still being answered when this one arrived
        n = len(state["bodies"])
        if state["fail_every"] and n % state["fail_every"] == 0:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        state["in_flight"] += 1  # until its stream ends (gen)

        def event(piece: str | None, finish=None) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if piece is None else {"content": piece}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": finish}
            return "data: " + json.dumps({"id": f"r{n}", "object": "chunk", "model": body["model"], "choices": [choice]}) + "\n\n"

        async def gen():
            try:
                yield event(None)  # empty content: not the first token
                for i, piece in enumerate(CHUNKS):
                    # sleep until the chunk's due time (from the arrival), so delays do not accumulate
                    due = arrived + FIRST_DELAY + GAP * i
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    yield event(piece)
                yield event("", finish="length")
                usage = {"prompt_tokens": USAGE_IN, "completion_tokens": USAGE_OUT, "total_tokens": USAGE_IN + USAGE_OUT}
                yield "data: " + json.dumps({"id": f"r{n}", "choices": [], "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    return app


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(create_app(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
