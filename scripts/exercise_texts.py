"""The cells that scripts/exercise_cells.py puts into the chapters: per exercise, what the answer cell holds (in English
and Japanese), its hints, and its answer, check and solution cells (the same code in both editions)."""

from __future__ import annotations

INTRO = {
    "en": (
        "Each exercise has an answer cell: replace its `...` with your answer, then run the check under it. "
        "`ex.qN.check(...)` compares your answer with what this machine measures now, or runs your code on cases it has "
        "not seen (in a real engine, or beside the real llama-server, where it plugs into one), and says ✓, or what "
        "differs, never the answer. `ex.qN.hint()` gives the next hint, one at a time (they are also under each "
        "exercise, closed); `ex.qN.solution()` shows the solution, which is also in the hidden cell under the check "
        "(the test suite runs it). An answer cell runs on its own when a class grades the notebook: import in it what "
        "it uses. Your progress is kept between sessions (`llmkit exercises` prints it in a terminal)."
    ),
    "ja": (
        "各演習には答えのセルがあります。その `...` を自分の答えに置き換えてから、下のチェックを実行してください。"
        "`ex.qN.check(...)` は、答えをこのマシンでいま測った値と比べるか、あなたのコードをまだ見ていないケースで動かし"
        "（差し込める場所があれば実際のエンジンの中で、また本物の llama-server と並べて）、✓ か、何が違うかを返します。"
        "答えそのものは言いません。`ex.qN.hint()` は次のヒントを一つずつ出します（ヒントは各演習の下にも閉じて置いてあります）。"
        "`ex.qN.solution()` は解答を見せます。解答はチェックの下の非表示のセルにもあり、テストスイートが実行します。"
        "クラスでノートブックを採点するときは答えのセルが単独で実行されるので、使うものはそのセルの中で import してください。"
        "進み具合はセッションをまたいで残ります（ターミナルでは `llmkit exercises` で表示できます）。"
    ),
    "extra": {
        2: {"en": "llama-server, started at the top, is still running.", "ja": "最初に起動した llama-server はまだ動いています。"},
        7: {
            "en": "Each exercise sends you into the C++ with `find`, asks for a prediction, and checks it on the running binary.",
            "ja": "どの演習でも、`find` で C++ のコードに入り、予想を立て、動いているバイナリでその予想を確かめます。",
        },
    },
}

CHAPTER_ZERO = {
    "section": {
        "en": (
            "## Your exercises\n\n"
            "Chapters 1–9 end with exercises that answer back: under each one an answer cell for your prediction or your "
            "code, and a check that compares it with what this machine measures, or runs your code in the engine and "
            "beside llama-server. The table shows which ones you have done; it is kept between sessions, and "
            "`llmkit exercises` prints it in a terminal."
        ),
        "ja": (
            "## あなたの演習\n\n"
            "第 1〜9 章の最後には、答えを確かめてくれる演習があります。各演習の下に、予想やコードを書く答えのセルと、"
            "それをこのマシンで測った値と比べたり、あなたのコードをエンジンの中で llama-server と並べて動かしたりするチェックがあります。"
            "下の表は、どの演習を終えたかを示します。進み具合はセッションをまたいで残り、ターミナルでは `llmkit exercises` で表示できます。"
        ),
    },
    "replace": {
        "en": [
            (
                "end with exercises whose solutions are hidden under each one (the test suite\nruns them).",
                "end with exercises that check your answers and your code (their solutions are\nhidden under each one, and the test suite runs them).",
            ),
            (
                "the course's apparatus: llama-server's source and binary, the bench, servers in the background, widgets, labels",
                "the course's apparatus: llama-server's source and binary, the bench, servers in the background, widgets, labels, the exercises' checks",
            ),
        ],
        "ja": [
            (
                "第 1〜9 章は演習で終わり、各演習の解答はその下の非表示のセルにあります（テストスイートが実行します）。",
                "第 1〜9 章は、答えとコードを確かめてくれる演習で終わります（各演習の解答はその下の非表示のセルにあり、テストスイートが実行します）。",
            ),
            (
                "the course's apparatus: llama-server's source and binary, the bench, servers in the background, widgets, labels",
                "the course's apparatus: llama-server's source and binary, the bench, servers in the background, widgets, labels, the exercises' checks",
            ),
        ],
    },
}

# Labels new solution cells print, by chapter catalog: msgid -> msgstr (notebooks/ja/locale/NN_*.po)
PO_ADDITIONS: dict[str, dict[str, str]] = {}

EXERCISES: list[dict] = []


def exercise(chapter: int, number: int, **spec) -> None:
    EXERCISES.append({"chapter": chapter, "number": number, **spec})


PO_RENAMES = {  # catalog -> (old msgid, new msgid, new msgstr)
    "00_start_here.po": (
        "the course's apparatus: llama-server's source and binary, the bench, servers in the background, widgets, labels",
        "the course's apparatus: llama-server's source and binary, the bench, servers in the background, widgets, labels, the exercises' checks",
        "コースの道具: llama-server のソースとバイナリ、ベンチマーク、バックグラウンドのサーバー、ウィジェット、ラベルの翻訳、演習のチェック",
    )
}

# --- chapter 1 ---------------------------------------------------------------------------------------------------------

exercise(
    1,
    1,
    answer_note={
        "en": "In the answer cell: your class `FailsAtOnce`, and `status_predicted`, the status code you predict the client gets. "
        "The check serves your translator, calls `/translate/stream` twice, and compares.",
        "ja": "答えのセルには、クラス `FailsAtOnce` と、クライアントが受け取ると予想するステータスコード `status_predicted` を書きます。"
        "チェックはあなたの翻訳器を動かし、`/translate/stream` を二度呼んで比べます。",
    },
    hints={
        "en": ["The status line goes out when the response starts: the stream's first `next()` comes after it."],
        "ja": ["ステータス行はレスポンスが始まったときに送られます。ストリームの最初の `next()` はその後です。"],
    },
    answer="""
# Your answer: a translator whose stream fails before its first token, and the status you predict
from llmkit.sequential.translator import Translator


class FailsAtOnce(Translator):
    def stream(self, text, target_lang="ja"):
        ...


status_predicted = ...
""",
    check="ex.q1.check(FailsAtOnce, status_predicted)",
    solution='''
class FailsAtOnce(Translator):
    """A translator whose stream fails before its first token."""

    def stream(self, text, target_lang="ja"):
        pieces = super().stream(text, target_lang)
        try:
            raise RuntimeError("failed before the first token (pretend)")
            yield  # a generator all the same
        finally:
            pieces.close()


status_predicted = 200  # the status line went out when the response started: the error can only travel inside the stream

logging.disable(logging.ERROR)
try:
    with launch.serve_app(create_app(FailsAtOnce(models.default_model_path(), temperature=0, max_tokens=16))) as url:
        early = httpx.post(f"{url}/translate/stream", json={"text": TEXT, "target_lang": LANG}, timeout=120)
finally:
    logging.disable(logging.NOTSET)
print(tr("ours        ->"), early.status_code, early.headers["content-type"], repr(early.text))
print("llama-server ->", refused.status_code, refused.headers["content-type"])
assert early.status_code == status_predicted and early.headers["content-type"].startswith("text/event-stream")  # sent when the response started
assert early.text.strip() == 'data: {"error": "failed before the first token (pretend)"}'  # the error is inside the stream
''',
)

exercise(
    1,
    2,
    answer_note={
        "en": "In the answer cell: `enough`, an `httpx.Timeout` (or its read timeout in seconds). The check sends the same "
        "request on this machine now, with your timeout, and wants a margin of at least twice the silence it measures.",
        "ja": "答えのセルには `enough` を書きます。`httpx.Timeout`（または読み取りタイムアウトの秒数）です。チェックはいまこのマシンで、"
        "あなたのタイムアウトで同じリクエストを送り、測った沈黙の少なくとも 2 倍の余裕を求めます。",
    },
    hints={
        "en": [
            "A timeout scaled on what you measured is safer than a number of seconds: `streamed_for` grows and shrinks with the machine."
        ],
        "ja": ["秒数を決め打ちするより、測った値に合わせたタイムアウトのほうが安全です。`streamed_for` はマシンに合わせて伸び縮みします。"],
    },
    answer="""
# Your answer: a read timeout for POST /translate with the same body (an httpx.Timeout, or seconds)
import httpx

enough = ...
""",
    check="ex.q2.check(enough)",
    solution="""
enough = httpx.Timeout(10.0, read=10 * streamed_for + 30)  # the whole generation is one silence; a busy machine can take several times as long
with launch.serve("sequential", "--temp", "0", "-n", "200", "-t", "1") as seq:
    t0 = time.perf_counter()
    patient = httpx.post(f"{seq.url}/translate", json={"text": LONG_TEXT, "target_lang": "Japanese"}, timeout=enough)
    silent_for = time.perf_counter() - t0
    streamed = client.stream_translation(seq.url, LONG_TEXT, "Japanese")  # the same translation, streamed, just after
    stream_gap = max(b - a for a, b in zip([0.0] + streamed.times, streamed.times))
print(tr("read timeout {timeout:.1f} s: {status}, after one silence of {seconds:.1f} s (the stream's longest was {gap:.2f} s)",
         timeout=enough.read, status=patient.status_code, seconds=silent_for, gap=stream_gap))
assert patient.status_code == 200 and patient.json()["translation"]
assert silent_for > 2 * stream_gap  # the whole generation is one silence, far longer than any wait in its stream
""",
)

exercise(
    1,
    3,
    answer_note={
        "en": "In the answer cell: two predictions, `split_alone` (some tokens are not valid UTF-8 alone) and "
        "`naive_shows_fffd` (a naive decode shows U+FFFD), each True or False. The check tokenizes the text with the model.",
        "ja": "答えのセルには二つの予想を書きます。`split_alone`（単独では有効な UTF-8 でないトークンがある）と `naive_shows_fffd`"
        "（素朴なデコードで U+FFFD が出る）で、どちらも True か False です。チェックはモデルでテキストをトークンに分けて確かめます。",
    },
    hints={
        "en": ["A token that is half a character decodes, alone, to U+FFFD: the two predictions go together."],
        "ja": ["文字の半分のトークンは、単独でデコードすると U+FFFD になります。二つの予想は連動します。"],
    },
    answer="""
# Your answer: two predictions, True or False
split_alone = ...  # some of the text's tokens are not valid UTF-8 on their own
naive_shows_fffd = ...  # decoding token by token shows U+FFFD
""",
    check="ex.q3.check(split_alone, naive_shows_fffd)",
    solution="""
split_alone, naive_shows_fffd = True, True  # an emoji is 4 bytes, spelled in byte-tokens: halves of a character, alone

other = "Привет, мир! 👋🙂"
other_pieces = [model.token_to_piece(t) for t in model.tokenize(other, add_special=False)]
halves = [p for p in other_pieces if not valid_utf8(p)]
detok = Detokenizer(model.token_to_piece)
sent = [detok.push(t) for t in model.tokenize(other, add_special=False)] + [detok.flush()]
print(tr("{tokens} tokens, {broken} not valid UTF-8 alone: {pieces}", tokens=len(other_pieces), broken=len(halves), pieces=halves))
print(tr("naive:"), "".join(p.decode("utf-8", errors="replace") for p in other_pieces), "|", tr("detokenizer:"), [p for p in sent if p])
assert bool(halves) == split_alone and ("\\ufffd" in "".join(p.decode("utf-8", errors="replace") for p in other_pieces)) == naive_shows_fffd
assert "".join(sent) == other and all(valid_utf8(p.encode()) for p in sent)
""",
)

# --- chapter 2 ---------------------------------------------------------------------------------------------------------

exercise(
    2,
    1,
    answer_note={
        "en": "In the answer cell: `error_message(response)`. The check calls it on error answers this notebook never "
        "showed, from the sequential server, the slot server and llama-server.",
        "ja": "答えのセルには `error_message(response)` を書きます。チェックは、このノートブックが見せていないエラーのレスポンスを、"
        "逐次サーバー、スロットサーバー、llama-server から集めて呼びます。",
    },
    hints={
        "en": ["`isinstance(error, str)` tells the two shapes apart."],
        "ja": ["`isinstance(error, str)` で二つの形を見分けられます。"],
    },
    answer="""
# Your answer: the message of an error answer, from either server
def error_message(response):
    ...
""",
    check="ex.q1.check(error_message)",
    solution=None,  # the notebook's solution defines error_message already
)

exercise(
    2,
    2,
    answer_note={
        "en": "In the answer cell: two predictions, `bang_in_text` (True if the `!` is in the answer's text) and "
        "`finish_reason` (a string). The check sends the request to both servers now.",
        "ja": "答えのセルには二つの予想を書きます。`bang_in_text`（答えのテキストに `!` が入るなら True）と `finish_reason`（文字列）です。"
        "チェックはいま両方のサーバーにリクエストを送ります。",
    },
    hints={
        "en": ["`finish_reason` has two values for an answer that ended by itself: `length` means the budget."],
        "ja": ["自分で終わった答えの `finish_reason` の値は二つです。`length` は予算を意味します。"],
    },
    answer="""
# Your answer: two predictions for chat_body sent with "stop": ["!"]
bang_in_text = ...  # True if the "!" is in the answer's text
finish_reason = ...  # the answer's finish_reason (a string)
""",
    check="ex.q2.check(bang_in_text, finish_reason)",
    solution="""
bang_in_text, finish_reason = False, "stop"  # a stop string ends the answer and is not part of it

stop_body = {**chat_body, "stop": ["!"]}
with launch.serve("slots", "-t", "1", "-np", "2", "-c", "4096") as slots:
    stopped = {"slots": httpx.post(f"{slots.url}/v1/chat/completions", json=stop_body, timeout=120).json()}
stopped["llama-server"] = httpx.post(f"{llama.url}/v1/chat/completions", json=stop_body, timeout=120).json()
full = chat["choices"][0]["message"]["content"]
for server, a in stopped.items():
    print(f"{server:12} {a['choices'][0]['message']['content']!r} finish_reason={a['choices'][0]['finish_reason']!r}")
assert "!" in full
assert stopped["slots"]["choices"][0]["message"]["content"] == full[:full.index("!")]  # cut before the stop string
for a in stopped.values():
    assert a["choices"][0]["finish_reason"] == finish_reason and ("!" in a["choices"][0]["message"]["content"]) == bang_in_text
""",
)

exercise(
    2,
    3,
    answer_note={
        "en": "In the answer cell: `exception_class`, the class you predict (`openai.SomeError`), and `n_ctx_of(exc)`, "
        "which returns the context size from the exception. The check raises it against the slot server and against "
        "a llama-server with another context size.",
        "ja": "答えのセルには、予想するクラス `exception_class`（`openai.SomeError` の形）と、例外からコンテキストの大きさを返す "
        "`n_ctx_of(exc)` を書きます。チェックはスロットサーバーと、コンテキストの大きさが違う llama-server で例外を起こして確かめます。",
    },
    hints={
        "en": ["400 is `BadRequestError` in the `openai` package; the error object's fields are in `exc.body`, a dict."],
        "ja": ["`openai` パッケージでは 400 は `BadRequestError` です。エラーのオブジェクトのフィールドは `exc.body`（dict）にあります。"],
    },
    answer="""
# Your answer: the exception class the openai client raises, and where your code finds n_ctx in it
import openai

exception_class = ...


def n_ctx_of(exc):
    ...
""",
    check="ex.q3.check(exception_class, n_ctx_of)",
    solution="""
exception_class = openai.BadRequestError  # 400: the class follows the status


def n_ctx_of(exc: openai.APIStatusError) -> int:
    return exc.body["n_ctx"]  # the parsed error object: llama-server's fields, as the server wrote them


with launch.serve("slots", "-t", "1", "-np", "2", "-c", "4096") as slots:
    try:
        OpenAI(base_url=f"{slots.url}/v1", api_key="not-needed").chat.completions.create(
            model="smollm2", messages=too_long["messages"], max_tokens=4)
        too_long_raised = None
    except openai.APIStatusError as exc:
        too_long_raised = exc
print(type(too_long_raised).__name__, too_long_raised.status_code, too_long_raised.body)
assert isinstance(too_long_raised, exception_class)
assert too_long_raised.body["type"] == "exceed_context_size_error" and n_ctx_of(too_long_raised) == 2048
""",
)

exercise(
    2,
    4,
    statement={
        "en": "**Exercise 4 — count before you send.** Both servers count a request's prompt tokens without generating "
        "anything: `POST /v1/responses/input_tokens` takes a Responses request, `POST /v1/messages/count_tokens` a "
        'Messages request (no `max_tokens` needed). Send the question of "Three chat APIs, one engine" to both '
        "routes, on the slot server and on llama-server. Predict the numbers: which field of the answers above do "
        "they equal? Anthropic's `input_tokens` (1 there), or another? Then write `prompt_size(answer)`: from a "
        "Messages answer alone (its `usage`), the number `count_tokens` gives for the same request.",
        "ja": "**演習 4 — 送る前に数える。** どちらのサーバーも、何も生成せずにリクエストのプロンプトのトークンを数えられます。"
        "`POST /v1/responses/input_tokens` は Responses のリクエストを、`POST /v1/messages/count_tokens` は Messages のリクエスト"
        "（`max_tokens` は要りません）を受け取ります。「三つのチャット API、一つのエンジン」の質問を両方のルートに、"
        "スロットサーバーと llama-server で送ってください。数を予想します。上の答えのどのフィールドと等しくなるでしょうか。"
        "Anthropic の `input_tokens`（そこでは 1）でしょうか、それとも別のものでしょうか。そのうえで `prompt_size(answer)` を書いてください。"
        "Messages の答え（その `usage`）だけから、同じリクエストに `count_tokens` が返す数を求める関数です。",
    },
    keep_hint=False,
    answer_note={
        "en": "In the answer cell: `prompt_size(answer)`. The check calls it on Messages answers of both servers, read "
        "from the cache or not, and compares with `count_tokens` for the same requests.",
        "ja": "答えのセルには `prompt_size(answer)` を書きます。チェックは、キャッシュから読んだものも読んでいないものも含む両方のサーバーの "
        "Messages の答えで呼び、同じリクエストの `count_tokens` と比べます。",
    },
    hints={
        "en": [
            "A count renders the prompt and tokenizes it; it looks at no cache.",
            "Anthropic's `usage` splits the prompt in two: what was read, and what came from the cache (`cache_read_input_tokens`).",
        ],
        "ja": [
            "数えるときは、プロンプトを組み立ててトークンに分けるだけで、キャッシュは見ません。",
            "Anthropic の `usage` はプロンプトを二つに分けます。読んだ分と、キャッシュから来た分（`cache_read_input_tokens`）です。",
        ],
    },
    answer="""
# Your answer: what count_tokens says for a Messages request, from its answer alone
def prompt_size(answer):
    ...
""",
    check="ex.q4.check(prompt_size)",
    solution='''
def prompt_size(answer: dict) -> int:
    """The whole prompt of a Messages answer: what was read, and what came from the KV cache."""
    usage = answer["usage"]
    return usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) + usage.get("cache_creation_input_tokens", 0)


counts = {"/v1/responses/input_tokens": {"model": "smollm2", "input": question},
          "/v1/messages/count_tokens": {"model": "smollm2", "messages": messages}}
with launch.serve("slots", "-t", "1", "-np", "1", "-c", "2048") as slots:
    counted = {("slots", path): httpx.post(slots.url + path, json=body, timeout=60).json() for path, body in counts.items()}
counted |= {("llama-server", path): httpx.post(llama.url + path, json=body, timeout=60).json() for path, body in counts.items()}
for (server, path), answer in counted.items():
    print(f"{server:12} {path:28} {answer}")
for (server, path), answer in counted.items():
    answers = three[server]
    assert answer["input_tokens"] == answers["chat", "whole"]["usage"]["prompt_tokens"]  # the whole prompt ...
    assert answer["input_tokens"] != answers["messages", "whole"]["usage"]["input_tokens"]  # ... not Anthropic's uncached part
    assert answer["input_tokens"] == prompt_size(answers["messages", "whole"])  # ... but both parts together
''',
)

exercise(
    2,
    5,
    answer_note={
        "en": "In the answer cell: `was_cut(api, answer, budget)`. The check calls it on answers it asks for now, of the "
        "three APIs on both servers, cut at another budget, whole, and ended by a stop string.",
        "ja": "答えのセルには `was_cut(api, answer, budget)` を書きます。チェックは、いま両方のサーバーで三つの API に求めた答え"
        "（別の予算で切られたもの、全部そろったもの、停止文字列で終わったもの）で呼びます。",
    },
    hints={
        "en": ["A stop string ends an answer too, and it is not the budget: Messages says `stop_sequence`, or llama-server's `end_turn`."],
        "ja": [
            "停止文字列も答えを終わらせますが、それは予算ではありません。Messages では `stop_sequence`、llama-server では `end_turn` です。"
        ],
    },
    answer="""
# Your answer: True when the token budget ended the answer, for any of the three APIs, from either server
def was_cut(api, answer, budget):
    ...
""",
    check="ex.q5.check(was_cut)",
    solution=None,
)

# --- chapter 3 ---------------------------------------------------------------------------------------------------------

exercise(
    3,
    1,
    answer_note={
        "en": "In the answer cell: `intact`, for each reader True if it still gets every chunk. The check records the "
        "French stream from the slot server now, puts the pings in, and reads it as the exercise says.",
        "ja": "答えのセルには `intact` を書きます。読み手ごとに、チャンクを全部まだ受け取れるなら True です。チェックはいまスロットサーバーから"
        "フランス語のストリームを記録し、ping を入れて、演習のとおりに読みます。",
    },
    hints={
        "en": ["`naive_parse` reads the whole body in one read here, and only looks at lines that start with `data: {`."],
        "ja": ["ここで `naive_parse` は本文を一度に読み、`data: {` で始まる行しか見ません。"],
    },
    answer="""
# Your answer: for each reader, True if it still gets every chunk of the pinged stream
intact = {"events_of": ..., "naive_parse": ..., "sse_parse": ...}
""",
    check="ex.q1.check(intact)",
    solution="""
intact = {"events_of": False, "naive_parse": True, "sse_parse": True}  # splitting on blank lines hands ": ping" to json.loads

pinged = raw_oai["French"].replace(b"\\n\\n", b"\\n\\n: ping\\n\\n")
clean = [json.loads(e) for e in events_of(raw_oai["French"])[:-1]]
by_split = events_of(pinged)
print(tr("{chunks} chunks; events_of now returns {pieces} pieces, e.g. {example!r}",
         chunks=len(clean), pieces=len(by_split), example=by_split[1]))
print(tr("naive_parse intact:"), naive_parse(replay(pinged, len(pinged))) == clean,
      "|", tr("sse_parse, 7-byte reads, intact:"), sse_parse(replay(pinged, 7)) == clean)
assert (sse_parse(replay(pinged, 7)) == clean) == intact["sse_parse"]  # a real SSE parser skips comments, wherever the reads cut
assert (naive_parse(replay(pinged, len(pinged))) == clean) == intact["naive_parse"]  # one read: no line is cut
assert (": ping" not in by_split) == intact["events_of"]  # splitting on blank lines hands the comments to json.loads
""",
)

exercise(
    3,
    2,
    answer_note={
        "en": "In the answer cell: `goes_on_for_nobody`, True if llama-server keeps generating after the client left. "
        "The check repeats the experiment on llama-server now.",
        "ja": "答えのセルには `goes_on_for_nobody` を書きます。クライアントが去った後も llama-server が生成を続けるなら True です。"
        "チェックはいま llama-server で実験を繰り返します。",
    },
    hints={
        "en": ["2,000 tokens take far longer than the few seconds the slot stays busy, or not."],
        "ja": ["2,000 トークンの生成には、スロットが処理中のままでいる数秒よりずっと長くかかります。そうなるかどうかを見てください。"],
    },
    answer="""
# Your answer: a prediction
goes_on_for_nobody = ...  # True if llama-server keeps generating after the client left
""",
    check="ex.q2.check(goes_on_for_nobody)",
    solution="""
goes_on_for_nobody = False  # handle_completions_impl checks should_stop() between results: the task is cancelled

with launch.serve("llama-server", "-np", "1", "-c", "4096", "-t", "1") as llama_leave:
    got = []
    with httpx.stream("POST", f"{llama_leave.url}/v1/chat/completions", json=leave_body, timeout=120) as r:
        for line in r.iter_lines():
            got += [line] if line.startswith("data: ") else []
            if len(got) == 8:
                break
    t_close = time.perf_counter()
    their_idle_after = wait_idle(llama_leave.url)
    probe_after = httpx.post(f"{llama_leave.url}/completion", json={"prompt": "Hi", "n_predict": 4, "ignore_eos": True}, timeout=120).json()
    their_n_decoded = probe_after["timings"]["predicted_n"]
print(tr("llama-server: the slot was idle {seconds:.2f} s after the client left", seconds=their_idle_after))
print(upstream.find("handle_completions_impl").around("stopping streaming due to should_stop condition", 2, 1))
assert (their_idle_after > 10) == goes_on_for_nobody  # far less than 2,000 tokens would take: it stopped for nobody
assert their_n_decoded == 4  # and the freed slot serves the next request
""",
)

exercise(
    3,
    3,
    answer_note={
        "en": "In the answer cell: two predictions, `openai_refuses` (the `openai` client refuses llama-server's Responses "
        "events) and `anthropic_gives_ping` (the `anthropic` client hands you the slot server's `ping`). The check "
        "streams through both clients now.",
        "ja": "答えのセルには二つの予想を書きます。`openai_refuses`（`openai` クライアントが llama-server の Responses のイベントを拒む）と "
        "`anthropic_gives_ping`（`anthropic` クライアントがスロットサーバーの `ping` を渡してくる）です。チェックはいま両方のクライアントで"
        "ストリーミングします。",
    },
    hints={
        "en": [
            "A client library parses what it knows and keeps going: a missing field is None, an event it has no use for may be dropped."
        ],
        "ja": [
            "クライアントライブラリは、知っているものを解析して先へ進みます。欠けたフィールドは None になり、使い道のないイベントは捨てられることがあります。"
        ],
    },
    answer="""
# Your answer: two predictions, True or False
openai_refuses = ...  # the openai client refuses llama-server's Responses events (they have no sequence_number)
anthropic_gives_ping = ...  # the anthropic client hands you the slot server's ping
""",
    check="ex.q3.check(openai_refuses, anthropic_gives_ping)",
    solution='''
import anthropic
from openai import OpenAI

openai_refuses, anthropic_gives_ping = False, False  # a missing field reads as None; a ping carries nothing to hand over


def typed_events(url: str) -> dict:
    """Each official client's typed events for the question, streamed, after warming the cache."""
    warm(url)
    oai = OpenAI(base_url=f"{url}/v1", api_key="not-needed")
    claude = anthropic.Anthropic(base_url=url, api_key="not-needed")
    return {
        "responses": list(oai.responses.create(model="smollm2", input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0, stream=True)),
        "messages": list(claude.messages.create(model="smollm2", messages=ASKED, max_tokens=MAX_TOKENS, stream=True,
                                               extra_body={"temperature": 0})),
    }


with launch.serve("slots", "-np", "2", "-c", "4096", "-t", "1") as slots, \\
     launch.serve("llama-server", "-np", "2", "-c", "4096", "-t", "1") as llama:
    typed = {"slots": typed_events(slots.url), "llama-server": typed_events(llama.url)}

for server, events in typed.items():
    text = {"responses": "".join(e.delta for e in events["responses"] if e.type == "response.output_text.delta"),
            "messages": "".join(e.delta.text for e in events["messages"] if e.type == "content_block_delta" and e.delta.type == "text_delta")}
    print(f"{server:12}", type(events["responses"][0]).__name__, "sequence_number:",
          [getattr(e, "sequence_number", None) for e in events["responses"][:4]], "|", tr("Messages event types:"),
          sorted({e.type for e in events["messages"]}))
    assert all(text[api] == WHOLE_TEXT[api](whole_api[server][api]) for api in text)
    assert any(e.type == "ping" for e in events["messages"]) == anthropic_gives_ping  # the anthropic client drops pings: they carry nothing
assert [getattr(e, "sequence_number", None) for e in typed["llama-server"]["responses"][:3]] == [None] * 3  # missing, not refused
assert not openai_refuses
''',
)

exercise(
    3,
    4,
    new=True,
    statement={
        "en": "**Exercise 4 — your own SSE reader.** Write `read_events(reads)`: it takes the body of a stream as it "
        "arrives, an iterable of `bytes` (network reads, cut anywhere: inside a line, inside a UTF-8 character), "
        "and returns its events as `(name, data)` pairs: `name` from the event's `event:` line (None without one), "
        "`data` its `data:` lines joined with a newline. Read it as the SSE specification does: a line ends at "
        "`\\n`, `\\r\\n` or `\\r`; a line that starts with `:` is a comment; a field's value loses one space after "
        "the colon; other fields (`id:`, `retry:`) are ignored; a blank line ends an event, if it has data; an "
        "event still open when the body ends is dropped.",
        "ja": "**演習 4 — 自分の SSE リーダー。** `read_events(reads)` を書いてください。ストリームの本文を届いたとおりに、"
        "`bytes` の反復可能オブジェクト（どこでも切れるネットワークの読み取り。行の途中でも、UTF-8 の文字の途中でも）として受け取り、"
        "そのイベントを `(name, data)` の組で返します。`name` はイベントの `event:` 行から取り（なければ None）、`data` はその "
        "`data:` 行を改行でつないだものです。SSE の仕様どおりに読んでください。行は `\\n`、`\\r\\n`、`\\r` のどれかで終わります。"
        "`:` で始まる行はコメントです。フィールドの値はコロンの後の空白を一つ落とします。ほかのフィールド（`id:`、`retry:`）は無視します。"
        "空行はデータのあるイベントを終わらせます。本文が終わった時点でまだ開いているイベントは捨てます。",
    },
    answer_note={
        "en": "In the answer cell: `read_events(reads)`. The check replays streams it records now from the slot server "
        "and llama-server (chat in French and Japanese, Responses, Messages), as sent and with pings, CRLF line "
        "ends, extra fields, a data split over two lines and an unfinished last event, in reads of 1, 7 and 4096 "
        "bytes, and compares every event with what the specification says.",
        "ja": "答えのセルには `read_events(reads)` を書きます。チェックは、いまスロットサーバーと llama-server から記録したストリーム"
        "（フランス語と日本語のチャット、Responses、Messages）を、そのままの形と、ping、CRLF の行末、余分なフィールド、"
        "二行に分かれた data、終わっていない最後のイベントを加えた形で、1、7、4096 バイトずつ読ませ、すべてのイベントを仕様どおりの結果と比べます。",
    },
    hints={
        "en": [
            "Keep bytes until a line is whole, and decode a line only then: a read can end inside a character.",
            "`\\r\\n` and `\\r`: turn them into `\\n` in the bytes you hold, but a `\\r` at the very end of a read may be "
            "the first half of a `\\r\\n`: wait for the next read.",
            'A blank line ends the event: append `(name, "\\n".join(data))` if there was data, then start afresh (name None, no data).',
        ],
        "ja": [
            "行がそろうまではバイトのまま持ち、そろってからデコードします。読み取りは文字の途中で終わることがあります。",
            "`\\r\\n` と `\\r` は、持っているバイトの中で `\\n` に置き換えます。ただし読み取りの最後の `\\r` は `\\r\\n` の前半かもしれないので、次の読み取りを待ちます。",
            '空行でイベントが終わります。データがあれば `(name, "\\n".join(data))` を加え、名前を None に、データを空にして始め直します。',
        ],
    },
    answer="""
# Your answer: an SSE reader, as the specification reads a stream
def read_events(reads):
    ...
""",
    check="ex.q4.check(read_events)",
    solution='''
def read_events(reads) -> list[tuple[str | None, str]]:
    """SSE, as the specification reads it: whole lines from bytes (\\n, \\r\\n or \\r), comments skipped, a field's
    value without its first space, data lines joined, a blank line ends an event that has data."""
    events, name, data, held = [], None, [], b""

    def take(line: str) -> None:
        nonlocal name, data
        if not line:  # a blank line: the event ends
            if data:
                events.append((name, "\\n".join(data)))
            name, data = None, []
        elif not line.startswith(":"):  # not a comment
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "data":
                data.append(value)
            elif field == "event":
                name = value

    for read in reads:
        held += read
        if held.endswith(b"\\r"):  # maybe the first half of \\r\\n: wait for the next read
            continue
        *lines, held = held.replace(b"\\r\\n", b"\\n").replace(b"\\r", b"\\n").split(b"\\n")
        for line in lines:
            take(line.decode("utf-8"))
    *lines, _ = held.replace(b"\\r\\n", b"\\n").replace(b"\\r", b"\\n").split(b"\\n")  # an unfinished last line is dropped
    for line in lines:
        take(line.decode("utf-8"))
    return events


for server in raw_api:
    for api in ("responses", "messages"):
        raw = raw_api[server][api]
        for size in (1, 7, len(raw)):
            assert read_events(raw[i : i + size] for i in range(0, len(raw), size)) == sse_events(raw), (server, api, size)
japanese = raw_oai["Japanese"]
by_httpx_sse = [(None, e.data) for e in EventSource(replay(japanese, 7)).iter_sse()]
print(tr("{n} events of the Japanese stream, read 7 bytes at a time: the same as httpx-sse's: {same}",
         n=len(by_httpx_sse), same=read_events(japanese[i : i + 7] for i in range(0, len(japanese), 7)) == by_httpx_sse))
assert read_events(japanese[i : i + 7] for i in range(0, len(japanese), 7)) == by_httpx_sse
''',
)
PO_ADDITIONS["03_sse_format.po"] = {
    "{n} events of the Japanese stream, read 7 bytes at a time: the same as httpx-sse's: {same}": "日本語のストリームのイベント {n} 個を 7 バイトずつ読んだ結果は httpx-sse と同じ: {same}",
}

# --- chapter 4 ---------------------------------------------------------------------------------------------------------

exercise(
    4,
    1,
    keep_hint=False,
    answer_note={
        "en": "In the answer cell: `steps_beside_two` and `steps_alone`, the prompt tokens of each step (two lists of "
        "numbers, in order). The check plans the steps with `build_batch` now.",
        "ja": "答えのセルには `steps_beside_two` と `steps_alone` を書きます。各ステップのプロンプトトークンの数（数のリストを二つ、順に）です。"
        "チェックはいま `build_batch` でステップを計画します。",
    },
    hints={
        "en": [
            "A generating stream puts one token in every step: beside two of them, how many of the 64 are left for the prompt?",
            "A busy slot and its job: `slot.job = Job(request, None, Detokenizer(bytes), StopMatcher(), request.prompt, n_done)` "
            "(from `llmkit.engine.job` and `llmkit.text`; no sampler, since nothing samples here), `n_done` the prompt's "
            "length for a generating one (then also `slot.append(request.prompt)` and `job.last_token = 7`), 0 for one "
            "still reading. `build_batch(busy, 512, budget)` takes `(slot, job)` pairs and returns the plan; to commit a "
            "chunk, `chunk.slot.append(chunk.tokens)` and, for a prompt chunk, `chunk.job.read(len(chunk.tokens))`.",
            "With no stream, read the docstring of `build_batch`: whom would the budget protect?",
        ],
        "ja": [
            "生成中のストリームは、毎ステップ 1 トークンを入れます。それが二つ並ぶと、64 のうちプロンプトに残るのはいくつでしょうか。",
            "処理中のスロットとそのジョブは `slot.job = Job(request, None, Detokenizer(bytes), StopMatcher(), request.prompt, n_done)` です"
            "（`llmkit.engine.job` と `llmkit.text` から。ここでは何もサンプリングしないのでサンプラーはなし）。`n_done` は、生成中ならプロンプトの長さ"
            "（このときは `slot.append(request.prompt)` と `job.last_token = 7` も）、まだ読んでいるなら 0 です。`build_batch(busy, 512, budget)` は "
            "`(slot, job)` の組を受け取って計画を返します。チャンクを反映するには `chunk.slot.append(chunk.tokens)`、プロンプトのチャンクなら "
            "`chunk.job.read(len(chunk.tokens))` もします。",
            "ストリームがないときは `build_batch` の docstring を読んでください。予算は誰を守るためのものでしょうか。",
        ],
    },
    answer="""
# Your answer: the prompt tokens of each step (two lists of numbers)
steps_beside_two = ...  # beside two generating streams, budget 64
steps_alone = ...  # with no stream, budget 64
""",
    check="ex.q1.check(steps_beside_two, steps_alone)",
    solution='''
from llmkit.engine.job import Job
from llmkit.engine.request import Request
from llmkit.engine.slot import Slot
from llmkit.text import Detokenizer, StopMatcher


def slot_with(slot_id: int, generating: bool, n_prompt: int) -> tuple[Slot, Job]:
    """A slot and the job on it, for a request with an n_prompt-token prompt: still to read, or read and generating."""
    slot, request = Slot(slot_id, 1024), Request(list(range(100, 100 + n_prompt)))
    n_done = n_prompt if generating else 0
    slot.job = Job(request, None, Detokenizer(bytes), StopMatcher(), request.prompt, n_done)  # no sampler: nothing samples here
    if generating:
        slot.append(request.prompt)
        slot.job.last_token = 7
    return slot, slot.job


def steps_to_read(n_streams: int, budget: int = 64, n_prompt: int = 300) -> list[int]:
    """The prompt tokens of each step until a newcomer's prompt is read, beside n_streams generating slots."""
    busy = [slot_with(i, True, 5) for i in range(n_streams)] + [slot_with(n_streams, False, n_prompt)]
    newcomer, steps = busy[-1][1], []
    while newcomer.n_prompt_done < n_prompt:
        plan = build_batch(busy, 512, budget)  # one step's plan: it changes nothing, ...
        for chunk in plan:  # ... so commit it, as Engine.commit does once the decode has succeeded
            chunk.slot.append(chunk.tokens)
            if chunk.is_prompt:
                chunk.job.read(len(chunk.tokens))
        steps.append(sum(len(chunk.tokens) for chunk in plan if chunk.is_prompt))
    return steps


steps_beside_two, steps_alone = steps_to_read(2), steps_to_read(0)
print(tr("beside 2 streams, budget 64, prompt tokens per step: {steps}", steps=steps_beside_two))
print(tr("no stream running, budget 64, prompt tokens per step: {steps}", steps=steps_alone))
assert steps_beside_two == [62, 62, 62, 62, 52]  # the streams take 2 of every 64: ceil(300 / 62) = 5 steps
assert steps_alone == [300]  # nobody waits on this step: the budget does not apply
''',
)

exercise(
    4,
    2,
    keep_hint=True,
    answer_note={
        "en": "In the answer cell: `widest` (the most slots one step serves) and `waited` (how many requests start only "
        "after the first one has ended), two numbers. The check runs the same engine now.",
        "ja": "答えのセルには `widest`（一つのステップが扱うスロットの最大数）と `waited`（最初のリクエストが終わってから始まるリクエストの数）の"
        "二つの数を書きます。チェックはいま同じエンジンを動かします。",
    },
    hints={
        "en": ["Each request's `outcome` has `t_start` (when it got a slot) and `t_end` (when it left it)."],
        "ja": ["各リクエストの `outcome` には `t_start`（スロットを得た時刻）と `t_end`（スロットを離れた時刻）があります。"],
    },
    answer="""
# Your answer: two numbers
widest = ...  # the most slots one step serves
waited = ...  # how many of the 6 requests start only after the first one has ended
""",
    check="ex.q2.check(widest, waited)",
    solution=None,  # the notebook's solution measures widest and waited
)

exercise(
    4,
    3,
    answer_note={
        "en": "In the answer cell: `decodes_alone`, the `llama_decode` calls each server makes for the prompt (a dict of "
        "three numbers). The check measures them now on the three servers (±1 at `-b 128`: the prompt is *about* "
        "1,400 tokens).",
        "ja": "答えのセルには `decodes_alone` を書きます。各サーバーがそのプロンプトのために呼ぶ `llama_decode` の回数です（三つの数の dict）。"
        "チェックはいま三つのサーバーで測ります（`-b 128` では ±1 を認めます。プロンプトは*約* 1,400 トークンだからです）。",
    },
    hints={
        "en": ["`-b` is the most tokens one `llama_decode` takes, always; llmkit's budget applies only to a step that carries a stream."],
        "ja": [
            "`-b` は一回の `llama_decode` が受け取るトークンの上限で、常にかかります。llmkit の予算は、ストリームを運ぶステップにだけかかります。"
        ],
    },
    answer="""
# Your answer: llama_decode calls for one prompt of about 1,400 tokens, alone
decodes_alone = {"llama-server -b 2048": ..., "llama-server -b 128": ..., "slot server": ...}
""",
    check="ex.q3.check(decodes_alone)",
    solution='''
LONE_TOKENS = 1400  # a made-up harbour log: one step at -b 2048, eleven or twelve at -b 128
decodes_alone = {"llama-server -b 2048": 1, "llama-server -b 128": math.ceil(LONE_TOKENS / 128), "slot server": 1}


def lone_prompt(url: str, tag: str) -> tuple[float, int, int]:
    """One long prompt, alone, for one token: (seconds to its first token, llama_decode calls, prompt tokens)."""
    messages = [{"role": "user", "content": long_text(None, LONE_TOKENS, tag)}]
    with httpx.Client(timeout=10) as client:
        before = scrape(client, url)["n_decode_total"]
        r = stream_chat(url, messages, max_tokens=1, temperature=0, cache_prompt=False)
        return r.ttft, round(scrape(client, url)["n_decode_total"] - before), r.usage["prompt_tokens"]


lone = {name: [] for name in SERVERS}
with contextlib.ExitStack() as started:
    urls = {name: started.enter_context(launch.serve(kind, "-np", "1", "-c", "2048", "-t", "1", "--metrics", *flags)).url
            for name, (kind, flags) in SERVERS.items()}  # fmt: skip
    for k, name in enumerate(tqdm([*SERVERS, *reversed(SERVERS)], desc=tr("lone prompts"))):  # A B C C B A, as the bursts
        lone[name].append(lone_prompt(urls[name], f"Lone {k}"))
first = {name: min(t for t, _, _ in runs_on) for name, runs_on in lone.items()}  # the shorter of the two runs
print(tr("prompt tokens: {tokens}", tokens=sorted({n for runs_on in lone.values() for _, _, n in runs_on})))
for name, runs_on in lone.items():
    print(tr("{server:27} | first token after {first:5.2f} s ({relative:.2f}x -b 2048's; runs: {runs}) | llama_decode calls: {decodes}",
             server=name, first=first[name], relative=first[name] / first[LLAMA_2048], runs=", ".join(f"{t:.2f} s" for t, _, _ in runs_on),
             decodes=[d for _, d, _ in runs_on]))
assert all(d == decodes_alone["llama-server -b 2048"] for _, d, _ in lone[LLAMA_2048])  # one step at -b 2048 ...
assert all(d == decodes_alone["slot server"] for _, d, _ in lone[SLOT_SERVER])  # ... and here: no stream runs, so no budget applies
assert all(d == math.ceil(n / 128) and abs(d - decodes_alone["llama-server -b 128"]) <= 1 for _, d, n in lone[LLAMA_128])  # -b caps every step
''',
)

exercise(
    4,
    4,
    new=True,
    statement={
        "en": "**Exercise 4 — a policy of your own.** The engine asks a scheduling policy (`llmkit.engine.scheduler.Policy`) "
        "four questions: in which order the waiting requests are offered a slot (`order`), which slot a request "
        "gets (`choose_slot`), which running job makes room for it (`victim`), and whose prompt fills a step first "
        "(`prompt_order`). Write `FewTokensFirst`, a policy that serves first the requests asking for the fewest "
        "tokens: a subclass of `LlamaServerPolicy` (it keeps llama-server's slot choice and never preempts) whose "
        "`order` sorts the waiting requests by `params.max_tokens`, fewest first, a request without a limit (`-1`) "
        "last, ties in arrival order (`request.id`), and whose `prompt_order` reads the prompts in the same order "
        "(it gets `(slot, job)` pairs; the request is `job.request`). Predict first: one slot, busy, and four "
        "requests waiting that ask for 12, 2, 40 and 6 tokens, in that order: in which order do they start?",
        "ja": "**演習 4 — 自分のポリシー。** エンジンはスケジューリングのポリシー（`llmkit.engine.scheduler.Policy`）に四つのことを尋ねます。"
        "待っているリクエストにどの順でスロットを渡すか（`order`）、リクエストがどのスロットを得るか（`choose_slot`）、動いているどのジョブが場所を空けるか"
        "（`victim`）、どのプロンプトが先にステップを埋めるか（`prompt_order`）です。求めるトークンが最も少ないリクエストを先に処理するポリシー "
        "`FewTokensFirst` を書いてください。`LlamaServerPolicy` のサブクラスで（llama-server のスロットの選び方を保ち、横取りはしません）、"
        "`order` は待っているリクエストを `params.max_tokens` の少ない順に並べ、上限のないリクエスト（`-1`）は最後、同じなら到着順（`request.id`）にします。"
        "`prompt_order` も同じ順でプロンプトを読みます（受け取るのは `(slot, job)` の組で、リクエストは `job.request` です）。先に予想してください。"
        "スロットが一つで使用中のとき、12、2、40、6 トークンを求める四つのリクエストがこの順で待っていたら、どの順に始まるでしょうか。",
    },
    answer_note={
        "en": "In the answer cell: the class `FewTokensFirst`. The check runs its `order` and `prompt_order` on requests it "
        "makes up, then puts it in a real engine with one slot (`EngineConfig(policy=FewTokensFirst())`) and "
        "compares the order in which the four requests start.",
        "ja": "答えのセルにはクラス `FewTokensFirst` を書きます。チェックは、作ったリクエストで `order` と `prompt_order` を動かしてから、"
        "スロット一つの実際のエンジン（`EngineConfig(policy=FewTokensFirst())`）に入れて、四つのリクエストが始まる順を比べます。",
    },
    hints={
        "en": [
            "`sorted(waiting, key=...)` with a tuple for the key: `(tokens asked, request.id)`. For `-1`, count `math.inf` tokens.",
            "A policy is a frozen dataclass with a class variable `name`: keep the answer cell's first lines as they are.",
            "`prompt_order(reading)` sorts pairs: the same key, of `pair[1].request`.",
        ],
        "ja": [
            "`sorted(waiting, key=...)` のキーにタプル `(求めるトークン数, request.id)` を使います。`-1` は `math.inf` トークンと数えます。",
            "ポリシーはクラス変数 `name` を持つ frozen の dataclass です。答えのセルの最初の数行はそのままにしてください。",
            "`prompt_order(reading)` は組を並べます。`pair[1].request` について同じキーを使います。",
        ],
    },
    answer="""
# Your answer: a scheduling policy (a class)
import math
from dataclasses import dataclass
from typing import ClassVar

from llmkit.engine.scheduler import LlamaServerPolicy


@dataclass(frozen=True)
class FewTokensFirst(LlamaServerPolicy):
    name: ClassVar[str] = "few-tokens-first"

    def order(self, waiting, slots):
        ...

    def prompt_order(self, reading):
        ...
""",
    check="ex.q4.check(FewTokensFirst)",
    solution='''
import math
from dataclasses import dataclass
from typing import ClassVar

from llmkit.engine.request import RequestParams, Status
from llmkit.engine.scheduler import LlamaServerPolicy


def tokens_asked(request) -> float:
    """A request's max_tokens; without a limit (-1), more than any."""
    return math.inf if request.params.max_tokens < 0 else request.params.max_tokens


@dataclass(frozen=True)
class FewTokensFirst(LlamaServerPolicy):
    """The requests asking for the fewest tokens first, in the queue and in a step; ties: arrival."""

    name: ClassVar[str] = "few-tokens-first"

    def order(self, waiting, slots):
        return sorted(waiting, key=lambda request: (tokens_asked(request), request.id))

    def prompt_order(self, reading):
        return sorted(reading, key=lambda pair: (tokens_asked(pair[1].request), pair[1].request.id))


def start_order(policy, limits=(12, 2, 40, 6)) -> list[int]:
    """One slot, a stream on it; requests asking for `limits` tokens wait: the tokens each asked, in the order they started."""
    with Engine(config=EngineConfig(n_parallel=1, n_ctx=1024, n_threads=1, cache_ram_mib=0, policy=policy), start=False) as engine:
        engine.submit(engine.model.tokenize("Once upon a time"), RequestParams.of(max_tokens=4, ignore_eos=True, temperature=0))
        engine.step()
        waiting = [engine.submit(engine.model.tokenize(f"Question {i}: name a river."), RequestParams.of(max_tokens=n, ignore_eos=True))
                   for i, n in enumerate(limits)]  # fmt: skip
        started = []
        while not all(r.done for r in waiting):
            engine.step()
            started += [limits[i] for i, r in enumerate(waiting) if r.status is not Status.WAITING and limits[i] not in started]
    return started


print(tr("started, as the tokens they asked for: {policy} with FewTokensFirst, {fifo} with llama-server's policy",
         policy=start_order(FewTokensFirst()), fifo=start_order(LlamaServerPolicy())))
assert start_order(FewTokensFirst()) == [2, 6, 12, 40] and start_order(LlamaServerPolicy()) == [12, 2, 40, 6]
''',
)
PO_ADDITIONS["04_concurrency.po"] = {
    "started, as the tokens they asked for: {policy} with FewTokensFirst, {fifo} with llama-server's policy": "始まった順（求めたトークン数で表示）: FewTokensFirst では {policy}、llama-server のポリシーでは {fifo}",
}

# --- chapter 5 ---------------------------------------------------------------------------------------------------------

exercise(
    5,
    1,
    answer_note={
        "en": "In the answer cell: `smallest_shared(n)`, the smallest *k* that keeps slot 1 for a prompt of *n* tokens, for "
        "any *n*. The check calls it on the three lengths above and on lengths it has not shown, and compares with "
        "`choose_slot`.",
        "ja": "答えのセルには `smallest_shared(n)` を書きます。*n* トークンのプロンプトでスロット 1 が選ばれ続ける最小の *k* を、どんな *n* にも返す関数です。"
        "チェックは上の三つの長さと、まだ見せていない長さで呼び、`choose_slot` と比べます。",
    },
    hints={
        "en": ["Is it `>` or `>=`? A prompt of 100 tokens sharing exactly 10 is exactly 10 %."],
        "ja": ["`>` でしょうか、`>=` でしょうか。100 トークンのプロンプトがちょうど 10 トークンを共有すると、ちょうど 10 % です。"],
    },
    answer="""
# Your answer: the smallest shared prefix that keeps slot 1, for a prompt of n tokens (a function)
def smallest_shared(n):
    ...
""",
    check="ex.q1.check(smallest_shared)",
    solution='''
def picks_similar_slot(k: int, n: int) -> bool:
    """Does a prompt of n tokens sharing its first k with slot 1 go there, slot 0 being least recently used?"""
    slots = [Slot(0, 1024), Slot(1, 1024)]
    shared = list(range(1000, 1000 + k))  # token ids: any prompt length, no model needed
    slots[1].cache_tokens = shared + [0] * 50  # the shared prefix, then tokens the prompt does not have
    slots[0].t_last_used, slots[1].t_last_used = 1.0, 2.0
    return choose_slot(slots, RequestParams(), shared + list(range(5000, 5000 + n - k))) is slots[1]


def smallest_shared(n: int) -> int:
    """Shorten the shared prefix until the slot is no longer chosen: the last k that kept it."""
    k = n
    while k > 0 and picks_similar_slot(k - 1, n):
        k -= 1
    return k


for n in (100, 150, 37):
    k = smallest_shared(n)
    print(tr("a {n}-token prompt keeps its slot from {k} shared tokens on ({share:.3f} of it)", n=n, k=k, share=k / n))
    assert k / n > 0.1 and (k - 1) / n <= 0.1  # the smallest k with k / n strictly above 10 %
''',
)

exercise(
    5,
    2,
    answer_note={
        "en": "In the answer cell: `share_moved_dropped`, the share of the new prompt's tokens moved in (a), from 0 to 1 "
        "(within ±0.1: the template's tokens are hard to count by eye), and `moved_inserted`, `moved_too_large`, the "
        "tokens moved in (b) and (c). The check runs the loop on the chapter's chat now.",
        "ja": "答えのセルには、(a) で新しいプロンプトのトークンのうち移動される割合 `share_moved_dropped`（0 から 1。テンプレートのトークンは目で数えにくいので ±0.1 を認めます）と、"
        "(b) と (c) で移動されるトークン数 `moved_inserted`、`moved_too_large` を書きます。チェックはいま章の会話でループを動かします。",
    },
    hints={
        "en": ["Which tokens does the loop skip when cache and prompt differ: the cache's, or the prompt's?"],
        "ja": [
            "キャッシュとプロンプトが食い違ったとき、ループが飛ばすのはキャッシュのトークンでしょうか、プロンプトのトークンでしょうか。"
        ],
    },
    answer="""
# Your answer: three predictions
share_moved_dropped = ...  # (a) the share of the new prompt's tokens moved, from 0 to 1
moved_inserted = ...  # (b) tokens moved
moved_too_large = ...  # (c) tokens moved
""",
    check="ex.q2.check(share_moved_dropped, moved_inserted, moved_too_large)",
    solution='''
class FakeContext:
    """Stands in for the llama_context: records the KV moves instead of making them."""
    def __init__(self):
        self.moves = []
    def seq_rm(self, seq, p0, p1):
        self.moves.append(("rm", p0, p1)); return True
    def seq_add(self, seq, p0, p1, delta):
        self.moves.append(("add", p0, p1, delta))


def moved(cached: list[dict], prompt: list[dict], min_chunk: int = 32) -> int:
    slot = Slot(0, 4096)
    slot.cache_tokens = MODEL.tokenize_chat(cached)
    new = MODEL.tokenize_chat(prompt)
    return slot.reuse_chunks(FakeContext(), new, common_prefix(slot.cache_tokens, new), min_chunk)


dropped = ORIGINAL[:1] + ORIGINAL[3:]  # the first user message and its answer left out
inserted = chat_history("My name is Ana, I am a painter, and I live in a small house by the sea.")
share_moved_dropped = moved(ORIGINAL, dropped) / len(MODEL.tokenize_chat(dropped))
moved_inserted, moved_too_large = moved(ORIGINAL, inserted), moved(ORIGINAL, EDITS["shortened"], min_chunk=1000)
print(tr("dropped message: {dropped} tokens moved;  inserted words: {inserted};  n_cache_reuse larger than any run: {too_large}",
         dropped=moved(ORIGINAL, dropped), inserted=moved_inserted, too_large=moved_too_large))
assert share_moved_dropped > 0.8  # taken out: the rest moves back
assert moved_inserted == 0  # put in: the prompt's new tokens are never skipped, so nothing matches
assert moved_too_large == 0
''',
)

exercise(
    5,
    3,
    answer_note={
        "en": "In the answer cell: `bytes_per_token` and `tokens_in_8192_mib`, two numbers. The check saves prompts in a "
        "prompt cache now and measures (within 10 %: a saved sequence also carries a small header).",
        "ja": "答えのセルには `bytes_per_token` と `tokens_in_8192_mib` の二つの数を書きます。チェックはいまプロンプトキャッシュにプロンプトを保存して測ります"
        "（10 % 以内を認めます。保存したシーケンスには小さなヘッダーも付くからです）。",
    },
    hints={
        "en": ["Three numbers from the metadata multiply out: layers, KV heads, and the head size; then K and V, and 2 bytes each."],
        "ja": [
            "メタデータの三つの数を掛け合わせます。層の数、KV ヘッドの数、ヘッドの大きさです。それに K と V の二つと、それぞれ 2 バイトを掛けます。"
        ],
    },
    answer="""
# Your answer: two numbers
bytes_per_token = ...  # bytes of KV cells one token takes
tokens_in_8192_mib = ...  # how many tokens the default 8192 MiB hold
""",
    check="ex.q3.check(bytes_per_token, tokens_in_8192_mib)",
    solution="""
n_layer = int(MODEL.meta("llama.block_count"))
n_head, n_head_kv = int(MODEL.meta("llama.attention.head_count")), int(MODEL.meta("llama.attention.head_count_kv"))
head_dim = MODEL.n_embd // n_head
bytes_per_token = n_layer * 2 * n_head_kv * head_dim * 2  # layers x (K and V) x KV heads x head size x 2 bytes (f16)
tokens_in_8192_mib = 8192 * MIB // bytes_per_token
print(tr("{n_layer} layers, {n_head_kv} KV heads of {head_dim}: {predicted} bytes a token predicted, {measured:.0f} measured",
         n_layer=n_layer, n_head_kv=n_head_kv, head_dim=head_dim, predicted=bytes_per_token, measured=per_token))
print(tr("so {limit} MiB hold about {tokens:.0f} tokens, and the default 8192 MiB about {many}",
         limit=LIMIT_MIB, tokens=LIMIT_MIB * MIB / bytes_per_token, many=large_number(tokens_in_8192_mib)))
assert abs(per_token - bytes_per_token) / bytes_per_token < 0.1  # the rest: a small header per saved sequence
""",
)

exercise(
    5,
    4,
    new=True,
    statement={
        "en": "**Exercise 4 — which cached prompt comes back.** When a request lands on a slot it shares little with, "
        "the slot's prompt goes to the RAM cache and the cached prompt that serves the request best comes back "
        "(`PromptCache.load`; in llama-server, `server_prompt_cache::load`). Write that choice: "
        "`choose_entry(entries, held, prompt)` gets the cached prompts' tokens (oldest first), the tokens the slot "
        "holds and the new prompt's tokens, and returns the index of the entry to bring back, or None to keep what "
        'the slot holds. Read the rule in `PromptCache.load` (or in the C++: `find("server_prompt_cache::load")`).',
        "ja": "**演習 4 — どのキャッシュ済みプロンプトが戻るか。** リクエストが、ほとんど共有しないスロットに割り当てられると、そのスロットのプロンプトは RAM "
        "キャッシュに移り、リクエストに最もよく合うキャッシュ済みのプロンプトが戻ってきます（`PromptCache.load`。llama-server では "
        "`server_prompt_cache::load`）。その選び方を書いてください。`choose_entry(entries, held, prompt)` は、キャッシュ済みプロンプトのトークン"
        "（古い順）、スロットが保持しているトークン、新しいプロンプトのトークンを受け取り、戻すエントリーの添字を返します。スロットの中身をそのまま使うなら "
        'None です。規則は `PromptCache.load`（C++ なら `find("server_prompt_cache::load")`）で読めます。',
    },
    answer_note={
        "en": "In the answer cell: `choose_entry(entries, held, prompt)`. The check runs it on cases it makes up, then in a "
        "real engine whose prompt cache chooses with it, on a workload of three texts taking turns on one slot, and "
        "compares the prompt tokens each request found in the cache with what the real llama-server found on the "
        "same workload.",
        "ja": "答えのセルには `choose_entry(entries, held, prompt)` を書きます。チェックは作ったケースで動かしてから、プロンプトキャッシュがこの関数で選ぶ"
        "実際のエンジンで、三つのテキストが一つのスロットを交代で使う負荷を流し、各リクエストがキャッシュから得たプロンプトトークンの数を、"
        "同じ負荷での本物の llama-server と比べます。",
    },
    hints={
        "en": [
            "Two shares decide: how much of the prompt an entry covers (common prefix / prompt) and how much of itself "
            "it keeps (common prefix / entry); what the slot holds sets the bar for both.",
            "An entry must beat the bar on both, strictly, and keep at least a quarter of itself (`MIN_KEEP`, \"don't "
            'trash large prompts").',
            "An empty slot keeps nothing: its share kept starts at -1, so any entry that keeps a quarter of itself can win.",
        ],
        "ja": [
            "二つの割合で決まります。エントリーがプロンプトのどれだけを覆うか（共通プレフィックス / プロンプト）と、エントリー自身のどれだけが残るか"
            "（共通プレフィックス / エントリー）です。スロットの中身が、その両方の基準になります。",
            'エントリーは両方で基準を厳密に上回り、しかも自分の 4 分の 1 以上を残さなければなりません（`MIN_KEEP`、"don\'t trash large prompts"）。',
            "空のスロットは何も残しません。残る割合の基準は -1 から始まるので、自分の 4 分の 1 を残すエントリーならどれでも勝てます。",
        ],
    },
    answer="""
# Your answer: the entry the prompt cache brings back (its index), or None
def choose_entry(entries, held, prompt):
    ...
""",
    check="ex.q4.check(choose_entry)",
    solution='''
from llmkit.engine.prompt_cache import MIN_KEEP


def choose_entry(entries: list[list[int]], held: list[int], prompt: list[int]) -> int | None:
    """server_prompt_cache::load's choice: the entry that covers more of the prompt AND keeps more of itself than
    the slot does, keeping at least a quarter of itself; None: keep what the slot holds."""
    lcp = common_prefix(held, prompt)
    keep_best, sim_best, best = (lcp / len(held) if held else -1.0), lcp / len(prompt), None
    for i, tokens in enumerate(entries):
        lcp = common_prefix(tokens, prompt)
        keep, sim = lcp / len(tokens), lcp / len(prompt)
        if keep >= MIN_KEEP and keep > keep_best and sim > sim_best:
            best, keep_best, sim_best = i, keep, sim
    return best


story, bread = HARBOUR[:120], BREAD[:60]
print(tr("the slot holds bread, the story is cached: entry {story}; the slot holds the story's start: {held}",
         story=choose_entry([story], bread, story[:100] + bread[:5]), held=choose_entry([story], story[:90], story[:100])))
assert choose_entry([story], bread, story[:100] + bread[:5]) == 0  # the story comes back
assert choose_entry([story], story[:90], story[:100]) is None  # the slot already holds more of itself than the entry would
assert choose_entry([story], [], story[:20] + bread) is None  # 20 of 120: under a quarter of the entry, not worth the copy
''',
)
PO_ADDITIONS["05_kv_cache.po"] = {
    "the slot holds bread, the story is cached: entry {story}; the slot holds the story's start: {held}": "スロットがパンの話を持ち、物語がキャッシュにあるとき: エントリー {story}。スロットが物語の冒頭を持つとき: {held}",
}

# --- chapter 6 ---------------------------------------------------------------------------------------------------------

exercise(
    6,
    1,
    answer_note={
        "en": "In the answer cell: `ISO_DATE`, your grammar (a string). The check parses it, tries it on dates and "
        "look-alikes it has not shown, then asks both servers questions it has not shown, with your grammar, at "
        "temperature 0.8.",
        "ja": "答えのセルには、文法 `ISO_DATE`（文字列）を書きます。チェックはそれを解析し、まだ見せていない日付と紛らわしい文字列で試してから、"
        "まだ見せていない質問をあなたの文法で temperature 0.8 で両方のサーバーに尋ねます。",
    },
    hints={
        "en": ["A day is `0` then `1`–`9`, `1` or `2` then any digit, or `3` then `0` or `1`."],
        "ja": ["日は、`0` のあとに `1`〜`9`、`1` か `2` のあとに任意の数字、または `3` のあとに `0` か `1` です。"],
    },
    answer="""
# Your answer: a GBNF grammar (a string) whose only answers are dates YYYY-MM-DD
ISO_DATE = ...
""",
    check="ex.q1.check(ISO_DATE)",
    solution=None,
)

exercise(
    6,
    2,
    answer_note={
        "en": "In the answer cell: `PERCENT`, your schema, and `strict_accepts`, True if the slot server accepts it with "
        "`strict: true`. The check sends it for reviews it has not shown, to the slot server and to llama-server.",
        "ja": "答えのセルには、スキーマ `PERCENT` と、スロットサーバーが `strict: true` でそれを受け付けるなら True の `strict_accepts` を書きます。"
        "チェックは、まだ見せていないレビューでスロットサーバーと llama-server に送ります。",
    },
    hints={
        "en": ['An integer from 0 to 100 is `{"type": "integer", "minimum": 0, "maximum": 100}`; keep the rest of `SCHEMA`.'],
        "ja": ['0 から 100 の整数は `{"type": "integer", "minimum": 0, "maximum": 100}` です。`SCHEMA` の残りはそのままにします。'],
    },
    answer="""
# Your answer: the schema, and a prediction
PERCENT = ...  # SCHEMA, with confidence an integer percentage from 0 to 100
strict_accepts = ...  # True if the slot server accepts it with strict: true
""",
    check="ex.q2.check(PERCENT, strict_accepts)",
    solution="""
PERCENT = {**SCHEMA, "properties": {**SCHEMA["properties"], "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}}
PERCENT_QUESTION = QUESTION.replace("confidence (0-1)", "confidence (an integer percentage, 0-100)")
strict_accepts = True  # the bounds of an integer are a grammar's business: strict has nothing to refuse


def ask_percent(url: str, review: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "user", "content": PERCENT_QUESTION + review}], "max_tokens": MAX_TOKENS, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "sentiment", "strict": True, "schema": PERCENT}}})


with launch.serve("slots", "-t", "1", "-np", "4", "-c", "4096") as slots:
    percents = client.concurrently(ask_percent, [(slots.url, review) for review in REVIEWS[:3]])
values = [json.loads(r.json()["choices"][0]["message"]["content"]) for r in percents]
print([r.status_code for r in percents], values)
assert all(r.status_code == 200 for r in percents) == strict_accepts  # bounds are enforceable: strict accepts them
assert all(isinstance(v["confidence"], int) and 0 <= v["confidence"] <= 100 for v in values)
""",
)

exercise(
    6,
    3,
    answer_note={
        "en": "In the answer cell: `WEATHER_UNIT`, your tool, and `every_call_valid`, True if every forced call has a valid "
        "unit. The check forces four calls for a question the notebook never asked, at temperature 0.8.",
        "ja": "答えのセルには、ツール `WEATHER_UNIT` と、強制したどの呼び出しも有効な単位を持つなら True の `every_call_valid` を書きます。"
        "チェックは、ノートブックが尋ねていない質問で、temperature 0.8 で四つの呼び出しを強制します。",
    },
    hints={
        "en": ["Build it from `WEATHER`: the same city, `unit` among the `properties`, both in `required`."],
        "ja": ["`WEATHER` から作ります。city はそのままで、`properties` に `unit` を加え、両方を `required` に入れます。"],
    },
    answer="""
# Your answer: the tool, and a prediction
WEATHER_UNIT = ...  # get_weather with a second required parameter, unit: "celsius" or "fahrenheit"
every_call_valid = ...  # True if every forced call has a valid unit
""",
    check="ex.q3.check(WEATHER_UNIT, every_call_valid)",
    solution="""
WEATHER_UNIT = {**WEATHER, "parameters": {**WEATHER["parameters"], "required": ["city", "unit"], "properties": {
    **WEATHER["parameters"]["properties"], "unit": {"enum": ["celsius", "fahrenheit"]}}}}
every_call_valid = True  # the rule is a choice of the two strings: a call can hold nothing else
unit_gbnf, _ = ToolCalling([Tool(**WEATHER_UNIT)], mode="required").grammar()
print(next(line for line in unit_gbnf.splitlines() if line.startswith("get-weather-arguments-unit ::=")))


def ask_unit(url: str, seed: int) -> dict:
    body = {"messages": [{"role": "user", "content": "What's the weather in New York, in Fahrenheit?"}], "max_tokens": 80,
            "tools": [{"type": "function", "function": WEATHER_UNIT}], "tool_choice": "required", "temperature": 0.8, "seed": seed}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()["choices"][0]


with launch.serve("slots", "-t", "1", "-np", "4", "-c", "4096") as slots:
    unit_answers = client.concurrently(ask_unit, [(slots.url, seed) for seed in range(4)])
unit_calls = [json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]) for c in unit_answers]
print(unit_calls)
assert all(jsonschema.Draft202012Validator(WEATHER_UNIT["parameters"]).is_valid(args) for args in unit_calls) == every_call_valid
assert all(args["unit"] in ("celsius", "fahrenheit") for args in unit_calls)
""",
)

exercise(
    6,
    4,
    answer_note={
        "en": "In the answer cell: `n_calls`, how many calls the answer holds without `parallel_tool_calls`. The check "
        "asks the slot server now.",
        "ja": "答えのセルには、`parallel_tool_calls` なしの答えに入る呼び出しの数 `n_calls` を書きます。チェックはいまスロットサーバーに尋ねます。",
    },
    hints={
        "en": ["Compare the two `root` rules: which one can repeat?"],
        "ja": ["二つの `root` 規則を比べてください。繰り返せるのはどちらでしょうか。"],
    },
    answer="""
# Your answer: a prediction
n_calls = ...  # calls in the answer to two cities, without parallel_tool_calls
""",
    check="ex.q4.check(n_calls)",
    solution="""
n_calls = 1  # the default grammar has room for one call, then the end

for parallel in (False, True):
    print(f"parallel={parallel!s:5}", ToolCalling([Tool(**WEATHER)], mode="required", parallel=parallel).grammar()[0].splitlines()[0])

TWO_CITIES = {"messages": [{"role": "user", "content": "What's the weather in Paris and in Tokyo?"}], "tools": TOOLS,
              "tool_choice": "required", "max_tokens": 120, "temperature": 0}
with launch.serve("slots", "-t", "1", "-np", "2", "-c", "4096") as slots:
    by_default = httpx.post(f"{slots.url}/v1/chat/completions", json=TWO_CITIES, timeout=600).json()["choices"][0]
    asked = httpx.post(f"{slots.url}/v1/chat/completions", json={**TWO_CITIES, "parallel_tool_calls": True}, timeout=600).json()["choices"][0]
print(table([(label, [c["function"]["arguments"] for c in choice["message"]["tool_calls"]])
             for label, choice in ((tr("default"), by_default), ("parallel_tool_calls: true", asked))]))
assert len(by_default["message"]["tool_calls"]) == n_calls  # the grammar allows one call, no more
assert all(valid_call(**c["function"]) for c in asked["message"]["tool_calls"])
""",
)

exercise(
    6,
    5,
    answer_note={
        "en": "In the answer cell: `call_mid_sentence`, True if some answer starts a call inside a sentence. The check asks "
        "the slot server now, at four seeds.",
        "ja": "答えのセルには、文の途中で呼び出しを始める答えがあるなら True の `call_mid_sentence` を書きます。チェックはいまスロットサーバーに四つのシードで尋ねます。",
    },
    hints={
        "en": ["To explain a tag, a model names it."],
        "ja": ["タグを説明するとき、モデルはその名前を書きます。"],
    },
    answer="""
# Your answer: a prediction
call_mid_sentence = ...  # True if some answer starts a call inside a sentence
""",
    check="ex.q5.check(call_mid_sentence)",
    solution="""
call_mid_sentence = True  # the trigger is a word in the text: naming the tag is writing it


def ask_about_the_tag(url: str, seed: int, temperature: float = 0.8) -> dict:
    body = {"messages": [{"role": "user", "content": "What is the <tool_call> tag for?"}], "tools": TOOLS,
            "max_tokens": 48, "temperature": temperature, "seed": seed}  # tool_choice: "auto"
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()["choices"][0]


with launch.serve("slots", "-t", "1", "-np", "4", "-c", "4096") as slots:
    about_tag = client.concurrently(ask_about_the_tag, [(slots.url, seed) for seed in range(4)])
for seed, choice in enumerate(about_tag):
    calls = [f'{c["function"]["name"]}({c["function"]["arguments"]})' for c in choice["message"].get("tool_calls") or []]
    print(seed, f'{choice["finish_reason"]:10}', repr((choice["message"]["content"] or "")[:50]), calls)
mid_sentence = [c for c in about_tag if c["message"]["content"] and c["message"].get("tool_calls")]
assert bool(mid_sentence) == call_mid_sentence  # text, then the word, then a call: the trigger fired inside a sentence
assert all(valid_call(**call["function"]) for c in about_tag if c["finish_reason"] == "tool_calls" for call in c["message"]["tool_calls"])
""",
)

# --- chapter 7 ---------------------------------------------------------------------------------------------------------

exercise(
    7,
    1,
    answer_note={
        "en": "In the answer cell: `b_by_similarity`, True if B takes A's slot by prompt similarity, and `share_cached`, "
        "for each of the four servers the share of the third request's prompt read from the cache, from 0 to 1 "
        "(within ±0.15: the template's and the questions' tokens are hard to count by eye). The check starts the "
        "four servers and sends the three requests now.",
        "ja": "答えのセルには、B がプロンプトの類似度で A のスロットを取るなら True の `b_by_similarity` と、四つのサーバーそれぞれで三つ目のリクエストの"
        "プロンプトのうちキャッシュから読んだ割合 `share_cached`（0 から 1。テンプレートと質問のトークンは目で数えにくいので ±0.15 を認めます）を書きます。"
        "チェックはいま四つのサーバーを起動して、三つのリクエストを送ります。",
    },
    hints={
        "en": ["Without the RAM cache, what is left of A once B has taken its slot? With it, where did A's cells go first?"],
        "ja": ["RAM キャッシュがなければ、B がスロットを取った後に A の何が残るでしょうか。あれば、A のセルは先にどこへ行ったでしょうか。"],
    },
    answer="""
# Your answer: a prediction, and the share of the third request's prompt read from the cache on each server
b_by_similarity = ...  # True if B takes A's slot, by prompt similarity
share_cached = {"llmkit": ..., "llmkit --cache-ram 0": ..., "llama-server": ..., "llama-server --cache-ram 0": ...}
""",
    check="ex.q1.check(b_by_similarity, share_cached)",
    solution='''
gas = find("get_available_slot")
print(gas.around("f_sim_cur > f_sim_best", before=4, after=2))
LONG_A = "You are a museum guide. " + " ".join(f"Room {i} shows paintings of the {i}th century." for i in range(20))


def three_requests(kind: str, *extra: str) -> tuple[list[int], int, list[str]]:
    """A, B, A again: cache_n of each, the third's prompt size, and (llama-server) how each slot was chosen."""
    ask = lambda url, system, q: httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}], "max_tokens": 2}).json()
    with launch.serve(kind, *FLAGS, *extra) as server:
        answers = [ask(server.url, LONG_A, "Where are the Dutch paintings?"), ask(server.url, "Translate to French.", "Good morning."),
                   ask(server.url, LONG_A, "When does the museum close?")]
        chosen = [line.split("| ", 2)[-1] for line in server.log().splitlines() if "get_availabl" in line]
    return [a["timings"]["cache_n"] for a in answers], answers[2]["usage"]["prompt_tokens"], chosen


b_by_similarity = True  # B's ~20 tokens share the template's first 3 with A: over 10 %
share_cached = {"llmkit": 0.9, "llmkit --cache-ram 0": 0.0, "llama-server": 0.9, "llama-server --cache-ram 0": 0.0}  # the RAM cache saved A first

runs = {"llmkit": three_requests("slots"), "llmkit --cache-ram 0": three_requests("slots", "--cache-ram", "0"),
        "llama-server": three_requests("llama-server"), "llama-server --cache-ram 0": three_requests("llama-server", "--cache-ram", "0")}
for name, (cached, n_prompt, _) in runs.items():
    print(tr("{name:28} cache_n of A, B, A again: {cached} (A again has {n_prompt} prompt tokens)",
             name=name, cached=cached, n_prompt=n_prompt))
print(tr("llama-server chose:"), *runs["llama-server"][2], sep="\\n  ")
share = {name: cached[2] / n_prompt for name, (cached, n_prompt, _) in runs.items()}
assert ("LCP similarity" in runs["llama-server"][2][1]) == b_by_similarity  # B took A's slot: 3 shared template tokens of ~20 are > 10 %
assert share["llmkit --cache-ram 0"] < 0.1 and share["llama-server --cache-ram 0"] < 0.1  # A's tokens were overwritten by B
assert share["llmkit"] > 0.8 and share["llama-server"] > 0.8  # ... unless the host-RAM prompt cache had saved them first
assert all(abs(share[name] - share_cached[name]) < 0.15 for name in share)
''',
)

exercise(
    7,
    2,
    answer_note={
        "en": "In the answer cell: `n_ctx_reported`, a number, and `refused_at_once`, for each server True if it refuses the "
        "too-long prompt at once while both slots are busy. The check repeats both on servers it starts now.",
        "ja": "答えのセルには、数 `n_ctx_reported` と、二つのスロットが使用中のときに長すぎるプロンプトをすぐ拒否するなら True を各サーバーについて書いた "
        "`refused_at_once` を書きます。チェックはいま起動したサーバーで両方を繰り返します。",
    },
    hints={
        "en": [
            "`-c` is the whole context: with `-np 2`, each slot gets its share. And a check that runs before a task is queued cannot wait for a slot."
        ],
        "ja": [
            "`-c` はコンテキスト全体です。`-np 2` なら各スロットはその分け前を得ます。また、タスクがキューに入る前に行う確認は、スロットを待てません。"
        ],
    },
    answer="""
# Your answer: a number, and a prediction per server
n_ctx_reported = ...  # the n_ctx the error reports on -np 2 -c 4096
refused_at_once = {"llmkit": ..., "llama-server": ...}  # True if it refuses at once while both slots are busy
""",
    check="ex.q2.check(n_ctx_reported, refused_at_once)",
    solution="""
n_ctx_reported = 4096 // 2  # each of the 2 slots gets its share of -c
refused_at_once = {"llmkit": True, "llama-server": False}  # Engine.submit refuses before queueing; pre_decode needs a slot first

pre = find("pre_decode")
print(pre.around("exceeds the available context size", before=6, after=3))
print(llmkit_symbol("llmkit.engine.engine.Engine.submit").around("raise ContextSizeError", before=1, after=0))
error = refused["llama-server"].json()["error"]
print({k: error[k] for k in ("n_prompt_tokens", "n_ctx")})
refused_tasks = re.findall(r"send_error: task id = (\\d+), error: request \\(\\d+ tokens\\) exceeds", real_log)
log_of = {task: [line[13:] for line in real_log.splitlines() if f"| task {task} |" in line or f"task id = {task}," in line]
          for task in refused_tasks}
for task, lines in log_of.items():
    print(tr("llama-server's log of refused task {task}:", task=task), *(line[:110] for line in lines), sep="\\n  ")
for name, run in busy.items():
    print(tr("{name:12} too long, both slots busy: {status}, when the busy streams had {at} of their {total} events",
             name=name, status=run["refused"].status_code, at=run["refusal"], total=run["total"]))
assert error["n_ctx"] == n_ctx_reported
first = lambda lines, words: next(i for i, line in enumerate(lines) if words in line)
assert len(log_of) == 2 and all(first(lines, "processing task") < first(lines, "send_error") for lines in log_of.values())  # a slot, then the error
assert all((max(busy[name]["refusal"]) < HALF) == at_once for name, at_once in refused_at_once.items())  # llmkit at submit; llama-server once a slot was free
""",
)

exercise(
    7,
    3,
    answer_note={
        "en": "In the answer cell: `n_decodes(n_prompt, n_batch)`, the decodes a server runs to read a prompt of `n_prompt` "
        "tokens alone, at `-b n_batch`, and sample one token. The check compares it with what llmkit's `build_batch` "
        "plans and with what both servers count in `/metrics` for prompts of other lengths, now.",
        "ja": "答えのセルには `n_decodes(n_prompt, n_batch)` を書きます。`-b n_batch` のサーバーが `n_prompt` トークンのプロンプトを単独で読み、トークンを一つ"
        "サンプリングするまでのデコードの回数です。チェックは、llmkit の `build_batch` の計画と、別の長さのプロンプトでいま両方のサーバーが `/metrics` "
        "で数えた回数と比べます。",
    },
    hints={
        "en": ["A decode takes at most `n_batch` prompt tokens, and the last one is the one sampled from: no extra decode for it."],
        "ja": [
            "一回のデコードが受け取るプロンプトトークンは最大 `n_batch` 個で、サンプリングは最後のデコードの結果から行います。そのための追加のデコードはありません。"
        ],
    },
    answer="""
# Your answer: the decodes that read a prompt of n_prompt tokens alone at -b n_batch (a function)
def n_decodes(n_prompt, n_batch):
    ...
""",
    check="ex.q3.check(n_decodes)",
    solution='''
def n_decodes(n_prompt: int, n_batch: int) -> int:
    return -(-n_prompt // n_batch)  # n_batch prompt tokens a decode, the rest next time: the ceiling


prompt_loop = pre.around("// add prompt tokens for processing in the current batch", before=0, after=25)
ours, fill = llmkit_symbol("llmkit.engine.scheduler.build_batch"), llmkit_symbol("llmkit.engine.engine.Engine.fill_batch")
print(prompt_loop.lines(prompt_loop.start, prompt_loop.start + 2))
print(prompt_loop.around("/* output    = */", before=3, after=2))
print(pre.around("// extract the logits only for the last token", before=6, after=1))
print(ours.around("room = limit - n_tokens", before=2, after=6))
print(fill)


def decodes(url: str) -> tuple[int, int]:
    """One chat request, one token asked: its prompt tokens, and how many decodes the server ran for it (/metrics)."""
    count = lambda: float(re.search(r"^llamacpp:n_decode_total (\\S+)", httpx.get(f"{url}/metrics", timeout=60).text, re.M).group(1))
    before = count()
    answer = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": LONG_A}], "max_tokens": 1}).json()
    return answer["usage"]["prompt_tokens"], round(count() - before)


with launch.serve("llama-server", *FLAGS, "-b", "64", "--metrics") as real_64, launch.serve("slots", *FLAGS, "-b", "64", "--metrics") as ours_64:
    split = {"llama-server": decodes(real_64.url), "llmkit": decodes(ours_64.url)}
for name, (n_prompt, n) in split.items():
    print(tr("{name:12} -b 64: a prompt of {n_prompt} tokens read in {n} decodes", name=name, n_prompt=n_prompt, n=n))
assert all(n == n_decodes(n_prompt, 64) for n_prompt, n in split.values())
''',
)

exercise(
    7,
    4,
    answer_note={
        "en": "In the answer cell: `first_block`, for each server the type of its answer's first content block "
        '(`"tool_use"` or `"text"`). The check asks both servers now, about another city.',
        "ja": '答えのセルには、各サーバーの答えの最初のコンテンツブロックの種類（`"tool_use"` か `"text"`）を書いた `first_block` を書きます。'
        "チェックはいま両方のサーバーに、別の都市について尋ねます。",
    },
    hints={
        "en": ["A grammar forces a call only if the tools reach the prompt, and a template that cannot write them leaves them out."],
        "ja": ["文法が呼び出しを強制するのは、ツールがプロンプトに届いたときだけです。ツールを書けないテンプレートは、それを省きます。"],
    },
    answer="""
# Your answer: the type of each server's first content block
first_block = {"llmkit": ..., "llama-server": ...}  # "tool_use" or "text"
""",
    check="ex.q4.check(first_block)",
    solution='''
from llmkit.server.messages import AnthropicToolChoice

first_block = {"llmkit": "tool_use", "llama-server": "text"}  # llmkit describes the tool in a system message; llama-server's template drops it

convert = find("server_chat_convert_anthropic_to_oai")
print(convert.around('type == "any"', before=1, after=1))
print(llmkit_symbol("llmkit.server.messages.AnthropicToolChoice.to_chat"))
print(find("oaicompat_chat_params_parse").around("auto chat_params = common_chat_templates_apply(", before=0, after=5))
to_json = find("server_task_result_cmpl_final::to_json_anthropic")
print(to_json.lines(to_json.start, to_json.start + 4))
TOOL = {"name": "get_weather", "description": "The current weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = {"model": "smollm2", "max_tokens": 64, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
       "tools": [TOOL], "tool_choice": {"type": "any"}}


def follow(url: str) -> dict:
    """The prompt's size with and without the tool (count_tokens), and the answer."""
    count = lambda body: httpx.post(f"{url}/v1/messages/count_tokens", json=body, timeout=300).json()["input_tokens"]
    return {"with": count({k: v for k, v in ASK.items() if k != "max_tokens"}), "without": count({"messages": ASK["messages"]}),
            "reply": httpx.post(f"{url}/v1/messages", json=ASK, timeout=300).json()}


with launch.serve("llama-server", *FLAGS) as real, launch.serve("slots", *FLAGS) as ours:
    caps = httpx.get(f"{real.url}/props", timeout=60).json()["chat_template_caps"]
    followed = {"llama-server": follow(real.url), "llmkit": follow(ours.url)}
print(tr("llama-server's /props: supports_tools={tools}, supports_tool_calls={calls}",
         tools=caps["supports_tools"], calls=caps["supports_tool_calls"]))
blocks = {name: [b["type"] for b in run["reply"]["content"]] for name, run in followed.items()}
for name, run in followed.items():
    print(tr("{name:12} prompt: {with_tools} tokens with the tool, {without} without; answer: {blocks}, stop_reason {reason}",
             name=name, with_tools=run["with"], without=run["without"], blocks=blocks[name], reason=run["reply"]["stop_reason"]))
call = followed["llmkit"]["reply"]["content"][0]
print(tr("llmkit's call: {name}({arguments})", name=call["name"], arguments=json.dumps(call.get("input"))))
assert AnthropicToolChoice(type="any").to_chat() == "required"  # any -> required, as llama-server's converter
assert not caps["supports_tools"] and followed["llama-server"]["with"] == followed["llama-server"]["without"]  # the tool never reached the prompt
assert followed["llmkit"]["with"] > followed["llmkit"]["without"] + 50  # described in the system message
assert blocks["llmkit"] == ["tool_use"] and followed["llmkit"]["reply"]["stop_reason"] == "tool_use" and "city" in call["input"]
assert "tool_use" not in blocks["llama-server"] and followed["llama-server"]["reply"]["stop_reason"] != "tool_use"
assert {name: kinds[0] for name, kinds in blocks.items()} == first_block
''',
)

exercise(
    7,
    5,
    new=True,
    statement={
        "en": '**Exercise 5 — `get_available_slot` in Python.** Read `find("get_available_slot")` line by line and write '
        "it: `get_available_slot(slots, params, tokens)` takes llmkit's `Slot`s (`is_idle`, `cache_tokens`, "
        "`similarity(tokens)`, and `t_last_used`, 0 for a slot never used), the request's `RequestParams` (its "
        "`id_slot`) and the tokens its prompt needs, and returns the slot llama-server takes, or None (the request "
        "waits). Leave the prompt cache out (`--cache-ram 0`). Mind each comparison: `>` or `>=`, `<` or `<=`. "
        "Predict first: two idle slots, neither ever used: which one does llama-server give the first request, "
        "and which one does llmkit's `choose_slot`?",
        "ja": '**演習 5 — `get_available_slot` を Python で。** `find("get_available_slot")` を一行ずつ読んで書いてください。'
        "`get_available_slot(slots, params, tokens)` は llmkit の `Slot`（`is_idle`、`cache_tokens`、`similarity(tokens)`、`t_last_used`。"
        "一度も使っていないスロットでは 0）と、リクエストの `RequestParams`（その `id_slot`）と、プロンプトが必要とするトークンを受け取り、"
        "llama-server が取るスロットか、None（リクエストは待つ）を返します。プロンプトキャッシュは除きます（`--cache-ram 0`）。比較の一つ一つに注意してください。"
        "`>` か `>=` か、`<` か `<=` かです。先に予想してください。どちらも一度も使っていない二つの空きスロットがあるとき、llama-server は最初のリクエストに"
        "どちらを与えるでしょうか。llmkit の `choose_slot` はどちらでしょうか。",
    },
    answer_note={
        "en": "In the answer cell: `get_available_slot(slots, params, tokens)`. The check runs it on cases it makes up, then "
        "plugs it into a real engine (a `LlamaServerPolicy` whose `choose_slot` calls yours) and compares the slot "
        "each request of a sequence gets with the slot the real llama-server gives the same sequence.",
        "ja": "答えのセルには `get_available_slot(slots, params, tokens)` を書きます。チェックは作ったケースで動かしてから、実際のエンジンに差し込み"
        "（`choose_slot` があなたの関数を呼ぶ `LlamaServerPolicy`）、一連のリクエストがそれぞれ得るスロットを、同じ一連のリクエストに本物の llama-server "
        "が与えるスロットと比べます。",
    },
    hints={
        "en": [
            "Three parts, in order: the slot named by `id_slot` (busy: wait); else the idle slot that holds some tokens "
            "and shares the most, if above 0.1; else the least recently used idle slot.",
            "In the similarity loop the comparison is strict: `f_sim_cur > f_sim_best`, so among equals the first one stays.",
            "In the least-recently-used loop it is `slot.t_last_used <= t_last`: among equals the *last* one wins, where "
            "llmkit's `min(...)` keeps the first.",
        ],
        "ja": [
            "三つの部分がこの順にあります。`id_slot` で名指しされたスロット（使用中なら待つ）、なければトークンを持つ空きスロットのうち最も多く共有するもの"
            "（0.1 を超えるなら）、それもなければ最も長く使われていない空きスロットです。",
            "類似度のループの比較は厳密です（`f_sim_cur > f_sim_best`）。同じ値なら最初のものが残ります。",
            "最も長く使われていないスロットのループでは `slot.t_last_used <= t_last` です。同じ値なら*最後*のものが勝ちます。llmkit の `min(...)` は最初のものを残します。",
        ],
    },
    answer="""
# Your answer: llama-server's slot choice, in Python (a function)
def get_available_slot(slots, params, tokens):
    ...
""",
    check="ex.q5.check(get_available_slot)",
    solution='''
from llmkit.engine.request import RequestParams
from llmkit.engine.scheduler import choose_slot
from llmkit.engine.slot import Slot


def get_available_slot(slots: list[Slot], params: RequestParams, tokens: list[int]) -> Slot | None:
    """llama-server's get_available_slot (server-context.cpp), without the prompt cache: the slot, or None (wait)."""
    if params.id_slot is not None:  # get_slot_by_id; a busy slot: the task waits for it
        slot = slots[params.id_slot]
        return slot if slot.is_idle else None
    best, sim_best = None, 0.0
    for slot in slots:  # the similarity loop: strictly better, strictly above the threshold
        if not slot.is_idle or not slot.cache_tokens:
            continue
        if slot.similarity(tokens) > sim_best and slot.similarity(tokens) > 0.1:
            best, sim_best = slot, slot.similarity(tokens)
    if best is not None:
        return best
    for slot in slots:  # least recently used: "<=", so among equals the last one
        if slot.is_idle and (best is None or slot.t_last_used <= best.t_last_used):
            best = slot
    return best


fresh = [Slot(0, 1024), Slot(1, 1024)]
print(tr("two idle slots, never used: llama-server's rule takes slot {theirs}, llmkit's choose_slot slot {ours}",
         theirs=get_available_slot(fresh, RequestParams(), [1, 2, 3]).id, ours=choose_slot(fresh, RequestParams(), [1, 2, 3]).id))
assert get_available_slot(fresh, RequestParams(), [1, 2, 3]).id == 1 and choose_slot(fresh, RequestParams(), [1, 2, 3]).id == 0
''',
)
PO_ADDITIONS["07_reading_llama_server.po"] = {
    "two idle slots, never used: llama-server's rule takes slot {theirs}, llmkit's choose_slot slot {ours}": "一度も使っていない二つの空きスロット: llama-server の規則はスロット {theirs}、llmkit の choose_slot はスロット {ours} を取ります",
}

# --- chapter 8 ---------------------------------------------------------------------------------------------------------

exercise(
    8,
    1,
    answer_note={
        "en": "In the answer cell: `gain_predicted`, the aggregate tokens per second of 4 clients over 1 on one slot. The "
        "check measures it on this machine now (within ±0.35: on one slot the clients take turns, and the turns' "
        "timing moves the gain by a few tenths from one run to the next).",
        "ja": "答えのセルには、スロット一つで 1 クライアントに対する 4 クライアントの合計の毎秒トークン数の比 `gain_predicted` を書きます。"
        "チェックはいまこのマシンで測ります（±0.35 を認めます。スロット一つではクライアントが順番を待ち、順番のタイミングで比が実行ごとに 0.1 の何倍か動くからです）。",
    },
    hints={
        "en": ["One slot decodes one sequence per step, whoever is waiting."],
        "ja": ["スロットが一つなら、誰が待っていても 1 ステップで一つのシーケンスしかデコードしません。"],
    },
    answer="""
# Your answer: a prediction
gain_predicted = ...  # aggregate tokens/s of 4 clients, over 1 client, on one slot
""",
    check="ex.q1.check(gain_predicted)",
    solution="""
gain_predicted = 1.0  # one slot: the four take turns, so together they get about what one gets

with launch.serve("slots", "-t", "1", "-np", "1", "-c", "4096") as one_slot:
    measure(one_slot.url, 1)  # warm-up: the first request also pages the model file in
    # 64 tokens each: generation, not the (partly cached) prompts, dominates the time
    one_slot_rows = [measure(one_slot.url, n, max_tokens=64) for n in (1, 4)]
gain_one_slot = one_slot_rows[1]["tokens_per_second"] / one_slot_rows[0]["tokens_per_second"]
print(tr("-np 1: 4 clients vs 1 = {gain:.2f}x aggregate tokens/s (-np 4 above: {gain_np4:.2f}x); "
         "median time to first token {ttft_1:.2f} s -> {ttft_4:.2f} s", gain=gain_one_slot, gain_np4=gain["slots"],
         ttft_1=one_slot_rows[0]["ttft_median_s"], ttft_4=one_slot_rows[1]["ttft_median_s"]))
assert abs(gain_one_slot - gain_predicted) < 0.5  # one slot: the requests take turns, so 4 clients get about what 1 gets
assert one_slot_rows[1]["ttft_median_s"] > 2 * one_slot_rows[0]["ttft_median_s"]  # ... and most of them wait for a turn
""",
)

exercise(
    8,
    2,
    answer_note={
        "en": "In the answer cell: `add_batch_route(app, translator)`, which adds the route to a sequential app. The check "
        "builds an app and its translator, adds your route, serves it, sends batches the notebook never sent, and "
        "asks `GET /health` while a batch is translated: the server must still answer.",
        "ja": "答えのセルには、逐次アプリにルートを追加する `add_batch_route(app, translator)` を書きます。チェックはアプリとその翻訳器を作ってあなたのルートを加え、"
        "動かして、ノートブックが送っていないバッチを送り、バッチの翻訳中に `GET /health` を尋ねます。サーバーはそれでも応答しなければなりません。",
    },
    hints={
        "en": [
            'Inside `add_batch_route`, decorate an async function with `@app.post("/translate/batch")`, as "A new endpoint" does with `app`.'
        ],
        "ja": [
            '`add_batch_route` の中で、「新しいエンドポイント」が `app` にしているように、async 関数を `@app.post("/translate/batch")` で飾ります。'
        ],
    },
    answer="""
# Your answer: add POST /translate/batch to a sequential app
import asyncio

from fastapi import Request


def add_batch_route(app, translator):
    ...
""",
    check="ex.q2.check(add_batch_route)",
    solution='''
import asyncio


def add_batch_route(app, translator) -> None:
    """POST /translate/batch: {"texts": [...], "target_lang": ...} -> {"translations": [...]}, each translated in a thread."""

    @app.post("/translate/batch")
    async def translate_batch(request: Request) -> dict:
        body = await request.json()
        lang = body.get("target_lang", "French")
        return {"translations": [await asyncio.to_thread(translator.translate, text, lang) for text in body["texts"]]}


batch_app = sequential_app.create_app(translator)
add_batch_route(batch_app, translator)
with launch.serve_app(batch_app) as url:
    batch = httpx.post(f"{url}/translate/batch", json={"texts": TEXTS}, timeout=600)
print(batch.status_code, batch.json())
assert batch.status_code == 200
assert batch.json()["translations"] == [e["translation"] for e in many[:-1]]  # greedy, one sequence: the same text
''',
)

exercise(
    8,
    3,
    new=True,
    statement={
        "en": "**Exercise 3 — your own stop strings.** Both servers hold back streamed text that could still become a stop "
        "string (`llmkit.text.StopMatcher`; in llama-server, `find_stopping_strings`). Write your own: a class "
        "`StopStrings(stops)` with `push(text)`, which takes the next piece of text and returns the part that is "
        "safe to send (never a part of a stop string, nor anything after one); `flush()`, which returns what is "
        "still held back when the generation ends without a stop; and two attributes, `stopped` (a stop string was "
        "found) and `word` (which one: the earliest in the text; at a tie, the first listed). Empty stop strings "
        "match nothing.",
        "ja": "**演習 3 — 自分の停止文字列。** どちらのサーバーも、これから停止文字列になるかもしれないストリーミングのテキストを送らずに持っておきます"
        "（`llmkit.text.StopMatcher`。llama-server では `find_stopping_strings`）。自分のものを書いてください。クラス `StopStrings(stops)` で、"
        "次のテキストの断片を受け取り、送っても安全な部分（停止文字列の一部でも、その後ろでもない部分）を返す `push(text)`、停止せずに生成が終わったとき"
        "まだ持っているものを返す `flush()`、そして二つの属性 `stopped`（停止文字列が見つかった）と `word`（どれか。テキストで最も早いもの、同じ位置なら"
        "先に並んだもの）を持ちます。空の停止文字列は何にも一致しません。",
    },
    answer_note={
        "en": "In the answer cell: the class `StopStrings`. The check runs it on pieces it makes up, then in a real engine "
        "(every job's stop matcher is one of yours) on three greedy completions with stop strings, and compares "
        "where each answer ends with llmkit's matcher and with the real llama-server.",
        "ja": "答えのセルにはクラス `StopStrings` を書きます。チェックは作った断片で動かしてから、実際のエンジン（どのジョブの停止文字列の照合器もあなたのもの）"
        "で停止文字列付きの貪欲デコードの補完を三つ行い、各答えが終わる場所を llmkit の照合器と本物の llama-server と比べます。",
    },
    hints={
        "en": [
            "Keep what you have not released in one string; after each push, look for every stop string in it.",
            'None found: release all but the longest tail that is the beginning of a stop string (`"go S"` may become `"go STOP"`).',
            "Found: release what comes before the earliest one, note it in `word`, set `stopped`, and release nothing more.",
        ],
        "ja": [
            "まだ出していないものを一つの文字列に持ちます。push のたびに、その中ですべての停止文字列を探します。",
            '見つからなければ、停止文字列の始まりになっている最も長い末尾を除いて全部出します（`"go S"` は `"go STOP"` になるかもしれません）。',
            "見つかったら、最も早いものより前を出し、それを `word` に記録して `stopped` を立て、その後は何も出しません。",
        ],
    },
    answer="""
# Your answer: a stop-string matcher (a class)
class StopStrings:
    def __init__(self, stops):
        ...

    def push(self, text):
        ...

    def flush(self):
        ...
""",
    check="ex.q3.check(StopStrings)",
    solution='''
class StopStrings:
    """Streamed text in, the part that is safe to send out: nothing that could still become a stop string."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.held, self.stopped, self.word = "", False, ""

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.held += text
        found = [(self.held.find(s), k, s) for k, s in enumerate(self.stops) if s in self.held]
        if found:  # the earliest; at a tie, the first listed
            at, _, self.word = min(found)
            self.stopped, out, self.held = True, self.held[:at], ""
            return out
        keep = max((n for s in self.stops for n in range(1, len(s)) if self.held.endswith(s[:n])), default=0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


matcher = StopStrings(["STOP"])
pushed = [matcher.push(piece) for piece in ("go go S", "T", "OP and more")]
print(pushed, matcher.stopped, repr(matcher.word))
assert pushed == ["go go ", "", ""] and matcher.stopped and matcher.word == "STOP"
''',
)

# --- chapter 9 ---------------------------------------------------------------------------------------------------------

exercise(
    9,
    1,
    answer_note={
        "en": "In the answer cell: `more_drafted_with_2`, True if `size_n` 2 drafts more tokens than 12. The check runs "
        "both on the COPY prompt now.",
        "ja": "答えのセルには、`size_n` 2 が 12 より多くのトークンをドラフトするなら True の `more_drafted_with_2` を書きます。チェックはいま COPY のプロンプトで両方を動かします。",
    },
    hints={
        "en": ["A shorter pattern is found more often; but a pattern of two tokens has often been followed by something else."],
        "ja": ["短いパターンほどよく見つかります。ただ、2 トークンのパターンの後には、ほかのものが続いていたことも多いはずです。"],
    },
    answer="""
# Your answer: a prediction
more_drafted_with_2 = ...  # True if size_n 2 drafts more tokens than size_n 12, on COPY with 96 tokens
""",
    check="ex.q1.check(more_drafted_with_2)",
    solution="""
more_drafted_with_2 = True  # a shorter pattern matches more often: more drafts, of which a smaller share is right

by_size = {}
with Engine(model, EngineConfig(n_parallel=1, n_ctx=2048, n_threads=1, speculative=SpecParams("ngram-simple"))) as engine:
    for size_n in (12, 4, 2):
        engine.drafter = NgramSimple(size_n, 48)
        r = engine.complete(COPY, max_tokens=96, temperature=0, ignore_eos=True)
        r.result()
        by_size[size_n] = (r.outcome.timings.draft_n, r.outcome.timings.draft_n_accepted, r.outcome.output)
for size_n, (drafted, accepted, _) in by_size.items():
    print(tr("size_n {n:>2}: {drafted} tokens drafted, {accepted} accepted ({share:.0%})", n=size_n, drafted=drafted, accepted=accepted,
             share=accepted / drafted if drafted else 0))
assert all(accepted <= drafted for drafted, accepted, _ in by_size.values())
assert (by_size[2][0] > by_size[12][0]) == more_drafted_with_2
""",
)

exercise(
    9,
    2,
    answer_note={
        "en": "In the answer cell: `longest_draft`, a number, and `more_steps`, True if the 48 tokens take more steps with "
        "`n_draft_max=4` than with the engine's drafts. The check runs both now.",
        "ja": "答えのセルには、数 `longest_draft` と、`n_draft_max=4` のほうがエンジンのドラフトより 48 トークンに多くのステップがかかるなら True の "
        "`more_steps` を書きます。チェックはいま両方を動かします。",
    },
    hints={
        "en": ["A step verifies at most `1 + n_draft_max` tokens of one request."],
        "ja": ["一つのステップが一つのリクエストについて確かめるトークンは、最大 `1 + n_draft_max` 個です。"],
    },
    answer="""
# Your answer: two predictions
longest_draft = ...  # the longest draft in engine.steps with n_draft_max=4
more_steps = ...  # True if the 48 tokens take more steps than with the engine's own drafts
""",
    check="ex.q2.check(longest_draft, more_steps)",
    solution="""
longest_draft, more_steps = 4, True  # drafts cut to the request's limit: at most 5 tokens a step

steps_for = {}
with Engine(model, EngineConfig(n_parallel=1, n_ctx=2048, n_threads=1, speculative=SpecParams("ngram-simple"))) as engine:
    engine.complete(COPY, max_tokens=1, temperature=0).result()  # the prompt into the cache
    for n_draft_max in (4, None):
        engine.steps.clear()
        r = engine.complete(COPY, max_tokens=48, temperature=0, ignore_eos=True, **({} if n_draft_max is None else {"n_draft_max": n_draft_max}))
        r.result()
        shares = [share for step in engine.steps for share in step.batch]
        steps_for[n_draft_max] = (len(engine.steps), max(share.n_draft for share in shares), r.outcome.timings.draft_n_accepted)
for n_draft_max, (n_steps, longest, accepted) in steps_for.items():
    print(tr("n_draft_max {n}: {steps} steps, longest draft {longest}, {accepted} draft tokens accepted",
             n=n_draft_max if n_draft_max is not None else tr("(the engine's)"), steps=n_steps, longest=longest, accepted=accepted))
assert steps_for[4][1] == longest_draft  # drafts cut to the request's n_draft_max
assert (steps_for[4][0] > steps_for[None][0]) == more_steps  # at most 5 tokens a step: more steps than with 48-token drafts
""",
)

exercise(
    9,
    3,
    statement={
        "en": "**Exercise 3 — a draft after an end of generation.** A draft copied from the prompt can run past an "
        "end-of-generation token (EOG). Find the line of `common_sampler_sample_and_accept_n` that stops accepting "
        "after an EOG, and the line of `Engine.sample` that does the same in llmkit. Then write llama-server's rule: "
        "`kept(draft, sampled, is_eog)` gets a draft, the token the sampler picks at each of its positions and one "
        "after it (`sampled`, one longer than `draft`) and a test for an EOG, and returns the tokens the step keeps, "
        "as `common_sampler_sample_and_accept_n` returns them. What does llama-server still keep when the EOG is "
        "the draft's last token?",
        "ja": "**演習 3 — 生成の終わりの後のドラフト。** プロンプトからコピーしたドラフトは、生成の終わりのトークン（EOG）を越えて続くことがあります。"
        "`common_sampler_sample_and_accept_n` の中で EOG の後の採用を止める行と、llmkit で同じことをする `Engine.sample` の行を見つけてください。"
        "そのうえで llama-server の規則を書きます。`kept(draft, sampled, is_eog)` は、ドラフトと、その各位置とその一つ先でサンプラーが選ぶトークン"
        "（`sampled`、`draft` より一つ長い）と、EOG かどうかを調べる関数を受け取り、`common_sampler_sample_and_accept_n` が返すとおりに、"
        "そのステップが残すトークンを返します。EOG がドラフトの最後のトークンのとき、llama-server はそれでも何を残すでしょうか。",
    },
    answer_note={
        "en": "In the answer cell: `kept(draft, sampled, is_eog)`. The check compares it with the C++ on drafts it makes up.",
        "ja": "答えのセルには `kept(draft, sampled, is_eog)` を書きます。チェックは作ったドラフトで C++ と比べます。",
    },
    keep_hint=True,
    hints={
        "en": [
            "The loop keeps the sampled token at position `i`, then stops if it differs from `draft[i]`, or if it is an "
            "EOG and not the draft's last position (`i + 1 < draft.size()`).",
            "A loop that ran through the whole draft samples one more token after it.",
        ],
        "ja": [
            "ループは位置 `i` でサンプリングしたトークンを残し、それが `draft[i]` と違うとき、または EOG でしかもドラフトの最後の位置でないとき"
            "（`i + 1 < draft.size()`）に止まります。",
            "ドラフトを最後までたどったループは、その後にもう一つトークンをサンプリングします。",
        ],
    },
    answer="""
# Your answer: the tokens a step keeps, by llama-server's rule (a function)
def kept(draft, sampled, is_eog):
    ...
""",
    check="ex.q3.check(kept)",
    solution='''
def kept(draft: list[int], sampled: list[int], is_eog) -> list[int]:
    """common_sampler_sample_and_accept_n: the sampled tokens a step keeps, in order."""
    result = []
    for i, token in enumerate(draft):
        result.append(sampled[i])
        if token != sampled[i] or (is_eog(sampled[i]) and i + 1 < len(draft)):
            return result
    return [*result, sampled[len(draft)]]  # the whole draft confirmed: one more token, sampled after it


cpp, py = find("common_sampler_sample_and_accept_n"), llmkit_symbol("llmkit.engine.engine.Engine.sample")
cpp_line, py_line = cpp.line_of("llama_vocab_is_eog"), py.line_of("self.model.is_eog(token)")
print(f"{cpp.path}:{cpp_line}: {cpp.text.splitlines()[cpp_line - cpp.start].strip()}")
print(f"{py.path}:{py_line}: {py.text.splitlines()[py_line - py.start].strip()}")
assert "i + 1 < draft.size()" in cpp.text.splitlines()[cpp_line - cpp.start]  # an EOG as the draft's LAST token is still accepted
assert py.text.splitlines()[py_line - py.start + 1].strip() == "break"  # llmkit stops at any EOG: the request ends there anyway
eog = lambda token: token == 2
assert kept([5, 6, 2], [5, 6, 2, 8], eog) == [5, 6, 2, 8] and kept([5, 2, 7], [5, 2, 7, 8], eog) == [5, 2]
''',
)

exercise(
    9,
    4,
    new=True,
    statement={
        "en": "**Exercise 4 — a drafter of your own.** The engine's drafter is anything with three methods "
        "(`llmkit.engine.speculative.Drafter`): `begin(seq, prompt)` when slot `seq` has read its prompt, "
        "`draft(seq, tokens, last, n_max)` for up to `n_max` tokens to follow what the slot holds (`tokens`) and "
        "the token it sampled last (`last`), and `accept(seq, n_drafted, n_accepted)` after each verification. "
        "Write `PromptLookup(n)`, prompt lookup decoding (as in vLLM and transformers): look the last `n` tokens "
        "(of `tokens` and `last`) up in the slot's *prompt* only; take their latest occurrence that has tokens "
        "after it in the prompt, and draft those tokens, at most `n_max`; no occurrence, no draft.",
        "ja": "**演習 4 — 自分のドラフター。** エンジンのドラフターは、三つのメソッドを持つものなら何でもかまいません（`llmkit.engine.speculative.Drafter`）。"
        "スロット `seq` がプロンプトを読み終えたときの `begin(seq, prompt)`、スロットが持つもの（`tokens`）と最後にサンプリングしたトークン（`last`）の"
        "後に続く最大 `n_max` 個のトークンを返す `draft(seq, tokens, last, n_max)`、確かめるたびに呼ばれる `accept(seq, n_drafted, n_accepted)` です。"
        "プロンプト参照によるデコード（vLLM や transformers と同じもの）の `PromptLookup(n)` を書いてください。（`tokens` と `last` の）最後の `n` 個のトークンを、"
        "スロットの*プロンプトだけ*から探します。その後にプロンプトのトークンが続く出現のうち最も後のものを取り、続くトークンを最大 `n_max` 個ドラフトにします。"
        "見つからなければドラフトはありません。",
    },
    answer_note={
        "en": "In the answer cell: the class `PromptLookup`. The check runs it on token lists it makes up, then as the "
        "drafter of a real engine (`engine.drafter = PromptLookup(3)`) on a copy prompt the notebook never used: "
        "some of its drafts must be accepted.",
        "ja": "答えのセルにはクラス `PromptLookup` を書きます。チェックは作ったトークンのリストで動かしてから、ノートブックが使っていない写しのプロンプトで、"
        "実際のエンジンのドラフター（`engine.drafter = PromptLookup(3)`）として動かします。ドラフトの一部が採用されなければなりません。",
    },
    hints={
        "en": [
            "`begin` keeps the prompt, per `seq` (a dict); `accept` has nothing to do.",
            "The pattern is `[*tokens, last][-n:]`. Search the prompt from its end backwards, starting where the pattern "
            "still leaves a token after it.",
            "The draft is `prompt[end : end + n_max]`, `end` just after the occurrence.",
        ],
        "ja": [
            "`begin` はプロンプトを `seq` ごとに（dict に）持っておきます。`accept` ですることはありません。",
            "パターンは `[*tokens, last][-n:]` です。プロンプトを後ろから前へ探し、パターンの後にまだトークンが残る位置から始めます。",
            "ドラフトは `prompt[end : end + n_max]` で、`end` は出現のすぐ後ろです。",
        ],
    },
    answer="""
# Your answer: a drafter (a class)
class PromptLookup:
    def __init__(self, n=3):
        ...

    def begin(self, seq, prompt):
        ...

    def draft(self, seq, tokens, last, n_max):
        ...

    def accept(self, seq, n_drafted, n_accepted):
        ...
""",
    check="ex.q4.check(PromptLookup)",
    solution='''
class PromptLookup:
    """Prompt lookup decoding: the last n tokens looked up in the slot's prompt; what followed them is the draft."""

    def __init__(self, n: int = 3):
        self.n, self.prompts = n, {}

    def begin(self, seq: int, prompt: list[int]) -> None:
        self.prompts[seq] = list(prompt)

    def draft(self, seq: int, tokens: list[int], last: int, n_max: int) -> list[int]:
        prompt, pattern = self.prompts.get(seq, []), [*tokens, last][-self.n :]
        for start in range(len(prompt) - len(pattern) - 1, -1, -1):  # the latest occurrence with a token after it
            if prompt[start : start + len(pattern)] == pattern:
                end = start + len(pattern)
                return prompt[end : end + n_max]
        return []

    def accept(self, seq: int, n_drafted: int, n_accepted: int) -> None:
        pass


with Engine(model, EngineConfig(n_parallel=1, n_ctx=2048, n_threads=1, speculative=SpecParams("ngram-simple"))) as engine:
    engine.drafter = PromptLookup(3)
    r = engine.complete(COPY, max_tokens=64, temperature=0, ignore_eos=True)
    r.result()
timings = r.outcome.timings
print(tr("prompt lookup on COPY: {drafted} tokens drafted, {accepted} accepted", drafted=timings.draft_n, accepted=timings.draft_n_accepted))
assert timings.draft_n_accepted > 0  # the answer copies the prompt: the prompt's own tokens are good guesses
''',
)
PO_ADDITIONS["09_speculative_decoding.po"] = {
    "prompt lookup on COPY: {drafted} tokens drafted, {accepted} accepted": "COPY でのプロンプト参照: ドラフト {drafted} トークン、採用 {accepted} トークン",
}
