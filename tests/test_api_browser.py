"""Headless chromium opens the web page, synthesizes, and the audio really plays (streamed, then in the element)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from api_bundles import flagged_bundle
from fastapi.testclient import TestClient
from gated_engine import FileGate
from servers import AppServer, Chromium, DevToolsPage, ManagedProcess, port_open, wait_until

from service.api import create_app
from service.bundle import ModelBundle
from service.settings import Settings

pytestmark = [pytest.mark.browser, pytest.mark.integration]

PROMPT = Path(__file__).parent / "reference" / "tiny" / "prompts" / "zh_16k.wav"
TEXT = "你好，欢迎使用语音合成。今天天气很好，我们去公园散步吧。"


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path) -> Iterator[AppServer]:
    """The tiny bundle with its manifest saying what it is (random weights, test model): the page shows a banner."""
    bundle = flagged_bundle(tiny_bundle, tmp_path_factory.mktemp("browser-bundle") / "tiny", random_weights=True, test_model=True)
    workdir = tmp_path_factory.mktemp("browser-app")
    # the engine holds each stream after every chunk while the gate file is missing (tests/gated_engine.py)
    server = AppServer(workdir, bundle, {"TTS_RATE_LIMIT_PER_MINUTE": "0"}, gate=workdir / "gate")
    server.start()
    yield server
    server.stop()
    server.dump_log()


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory, app: AppServer) -> Iterator[DevToolsPage]:
    chromium = Chromium(tmp_path_factory.mktemp("chromium"))
    # a fake microphone (a beeping tone) that getUserMedia may use without a permission prompt
    chromium.argv[-1:-1] = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]
    chromium.start()
    tab = chromium.page()
    try:
        tab.navigate(app.base_url + "/")
        tab.wait_for("window.tts && window.tts.voicesLoaded && window.tts.info", 20, "the voice list and /info")
        yield tab
    finally:
        print("browser console:", tab.console)
        tab.close()
        chromium.stop()
        chromium.dump_log()


def speak(page: DevToolsPage, fmt: str) -> int:
    """Fill the form, click Speak (a real click: a user gesture), and return the number of this run."""
    choose(page, fmt)
    run = int(page.eval("tts.runs")) + 1
    page.click("#speak")
    return run


def choose(page: DevToolsPage, fmt: str) -> None:
    page.eval(f"""(() => {{
        document.getElementById('text').value = {TEXT!r};
        document.getElementById('format').value = '{fmt}';
        document.getElementById('text').dispatchEvent(new Event('input'));
    }})()""")


def test_page_lists_the_bundle_voices(page: DevToolsPage) -> None:
    voices = page.eval("[...document.getElementById('voice').options].map(o => o.value)")
    assert "中文女" in voices
    assert page.eval("document.getElementById('error').textContent") == ""


def test_banner_warns_that_the_model_is_a_random_weight_test_model(page: DevToolsPage) -> None:
    banner = page.eval(
        "({hidden: document.getElementById('banner').hidden, text: document.getElementById('banner').textContent})"
    )
    assert not banner["hidden"] and "random weights" in banner["text"] and "noise" in banner["text"], banner


def test_counter_shows_the_limit_and_speak_is_refused_over_it(page: DevToolsPage, repo_root: Path) -> None:
    limit = page.eval("tts.maxChars")
    assert limit == 4096
    page.eval(f"(() => {{ const t = document.getElementById('text'); t.value = 'a'.repeat({limit + 3});"
              " t.dispatchEvent(new Event('input')); })()")  # fmt: skip
    state = page.eval(
        "({count: document.getElementById('count').textContent, disabled: document.getElementById('speak').disabled})"
    )
    assert state["count"] == f"({limit + 3} / {limit} characters: 3 over the limit)" and state["disabled"], state
    page.screenshot(repo_root / "test-artifacts" / "browser-over-limit.png")
    choose(page, "wav")  # back to the normal text
    assert page.eval("document.getElementById('count').textContent") == f"({len(TEXT)} / {limit} characters)"
    assert page.eval("document.getElementById('speak').disabled") is False


def test_streamed_wav_plays_through_web_audio_while_it_arrives(page: DevToolsPage, app: AppServer, repo_root: Path) -> None:
    assert app.gate_path is not None
    gate = FileGate(app.gate_path)
    gate.clear()  # the server holds the stream after its first chunk: the page must play what it has by then
    try:
        run = speak(page, "wav")
        page.wait_for(f"tts.runs === {run} && tts.scheduledSeconds > 0", 60, "the first scheduled samples")
        partial = page.eval(
            "({seconds: tts.scheduledSeconds, done: tts.done, progress: document.getElementById('progress').textContent})"
        )
    finally:
        gate.set()
    assert not partial["done"], "the first audio was only scheduled once the whole response was in"
    assert partial["progress"].startswith("Receiving: ") and " s of audio in " in partial["progress"], partial
    page.screenshot(repo_root / "test-artifacts" / "browser-streaming.png")
    t1 = page.eval("tts.ctx.currentTime")
    time.sleep(0.6)
    t2 = page.eval("tts.ctx.currentTime")
    assert page.eval("tts.ctx.state") == "running"
    assert t2 - t1 > 0.3, f"the audio clock does not advance: {t1} -> {t2}"
    # samples really reach the output: the analyser between the sources and the speakers sees signal
    page.wait_for("tts.ctx.currentTime > tts.startTime && tts.level() > 1e-4", 10, "audible output")
    page.wait_for("tts.done || tts.error", 120, "the end of the stream")
    state = page.eval(
        "({done: tts.done, error: tts.error, mode: tts.mode, bytes: tts.bytes, seconds: tts.scheduledSeconds,"
        " firstAudioMs: tts.firstAudioMs, doneMs: tts.doneMs})"
    )
    assert state["done"] and state["error"] == "", state
    assert state["mode"] == "webaudio" and state["bytes"] > 44
    assert state["firstAudioMs"] < state["doneMs"], f"playback only started after the download ended: {state}"
    assert partial["seconds"] < state["seconds"]
    # every received sample was scheduled: 16-bit mono after the 44-byte header
    assert state["seconds"] == pytest.approx((state["bytes"] - 44) / 2 / 22050, abs=0.01)
    page.screenshot(repo_root / "test-artifacts" / "browser.png")
    assert (repo_root / "test-artifacts" / "browser.png").stat().st_size > 5000


def test_finished_file_plays_in_the_audio_element(page: DevToolsPage) -> None:
    run = speak(page, "wav")
    page.wait_for(f"tts.runs === {run} && (tts.done || tts.error)", 120, "the wav response")
    page.wait_for("document.getElementById('player').src.startsWith('blob:')", 10, "the finished file in the player")
    page.eval("document.getElementById('player').play()")
    page.wait_for("document.getElementById('player').currentTime > 0.2", 20, "the audio element to play")
    assert page.eval("document.getElementById('player').error") is None
    page.eval("document.getElementById('player').pause()")


def test_streamed_raw_pcm_plays_at_the_sample_rate_the_server_names(page: DevToolsPage) -> None:
    assert page.eval("document.getElementById('player').src").startswith("blob:"), "the previous test left a wav clip"
    run = speak(page, "pcm")
    # the new result replaces the old one at once: the previous wav clip is gone from the player
    assert page.eval("document.getElementById('player').getAttribute('src')") is None
    assert page.eval("document.getElementById('download').hidden") is True
    page.wait_for(f"tts.runs === {run} && (tts.done || tts.error)", 120, "the pcm response")
    state = page.eval("({error: tts.error, mode: tts.mode, bytes: tts.bytes, seconds: tts.scheduledSeconds})")
    assert state["error"] == "" and state["mode"] == "webaudio", state
    assert state["seconds"] == pytest.approx(state["bytes"] / 2 / 22050, abs=0.01)
    assert page.eval("document.getElementById('download').download") == "speech.pcm"
    assert page.eval("document.getElementById('player').getAttribute('src')") is None, "pcm has no clip to show"
    assert page.eval("document.getElementById('progress').textContent").startswith("Done: ")


def test_mp3_streams_into_the_audio_element(page: DevToolsPage) -> None:
    run = speak(page, "mp3")
    page.wait_for(f"tts.runs === {run} && (tts.done || tts.error)", 120, "the mp3 response")
    assert page.eval("tts.error") == ""
    streamed = page.eval("!!window.MediaSource && MediaSource.isTypeSupported('audio/mpeg')")
    assert page.eval("tts.mode") == ("mediasource" if streamed else "element")
    page.wait_for("document.getElementById('player').currentTime > 0.2", 20, "mp3 playback")


def test_server_error_is_shown_from_the_json_body(page: DevToolsPage) -> None:
    page.eval("""(() => {
        const sel = document.getElementById('voice');
        sel.add(new Option('missing', 'no-such-speaker'));
        sel.value = 'no-such-speaker';
    })()""")
    speak(page, "wav")
    message = page.wait_for("document.getElementById('error').textContent", 30, "an error message")
    assert "no-such-speaker" in message or "speaker" in message.lower(), message
    assert not message.startswith("HTTP "), f"the JSON error body was not used: {message}"
    page.wait_for("!tts.busy", 10, "the failed run to end")
    assert page.eval("document.getElementById('progress').textContent").startswith("Failed: ")


def click(page: DevToolsPage, selector: str) -> None:
    """Scroll the element into view first: the mouse click lands at viewport coordinates."""
    page.eval(f"document.querySelector({selector!r}).scrollIntoView({{block: 'center'}})")
    page.click(selector)


def choose_file(page: DevToolsPage, path: Path) -> None:
    """Put a file into the page's file picker as a user would (JS cannot set a file input); `change` fires."""
    node = page.send("Runtime.evaluate", expression="document.getElementById('promptFile')")["result"]
    page.send("DOM.setFileInputFiles", files=[str(path)], objectId=node["objectId"])
    page.wait_for(f"clone.prompt && clone.prompt.filename === {path.name!r}", 10, "the chosen file")


def save_voice(page: DevToolsPage, name: str, transcript: str = "") -> str:
    """Fill the name and transcript, click Save voice; return the status or the error the page shows."""
    page.eval(f"""(() => {{
        document.getElementById('voiceName').value = {name!r};
        document.getElementById('transcript').value = {transcript!r};
        document.getElementById('cloneStatus').textContent = '';
    }})()""")
    click(page, "#saveVoice")
    return str(
        page.wait_for(
            "document.getElementById('cloneError').textContent ||"
            " (document.getElementById('cloneStatus').textContent.startsWith('Saved') && !clone.busy"
            "  && document.getElementById('cloneStatus').textContent)",
            60,
            "the saved voice or an error",
        )
    )


def saved_names(page: DevToolsPage) -> dict[str, list[str]]:
    """Saved voices as the server, the page's list and the voice select see them."""
    return dict(
        page.eval("""(async () => ({
        server: (await (await fetch('v1/voices')).json()).data.map(v => v.name),
        list: [...document.querySelectorAll('#savedVoices li')].map(li => li.dataset.id),
        select: [...document.getElementById('voice').options].map(o => o.value),
    }))()""")
    )


def delete_voice(page: DevToolsPage, name: str) -> None:
    """Delete, then confirm (the page asks once more)."""
    click(page, f'#savedVoices li[data-id="{name}"] button[data-role=delete]')
    click(page, f'#savedVoices li[data-id="{name}"] button[data-role=confirm]')
    page.wait_for(
        f"!document.querySelector('#savedVoices li[data-id=\"{name}\"]')"
        f" && ![...document.getElementById('voice').options].some(o => o.value === {name!r})",
        20,
        "the deletion",
    )


def test_a_saved_voice_from_a_file_appears_speaks_and_is_deleted(page: DevToolsPage, repo_root: Path) -> None:
    choose_file(page, PROMPT)
    status = save_voice(page, "file-voice", "希望你以后能够做的比我还好呦。")
    assert status.startswith('Saved "file-voice"'), status
    names = saved_names(page)
    assert names["server"] == ["file-voice"] and names["list"] == ["file-voice"], names
    assert "file-voice" in names["select"] and "中文女" in names["select"], names
    assert page.eval("document.getElementById('voice').value") == "file-voice", "the new voice is not selected"
    page.eval("document.getElementById('cloning').scrollIntoView()")
    page.screenshot(repo_root / "test-artifacts" / "browser-cloning.png")
    run = speak(page, "wav")
    page.wait_for(f"tts.runs === {run} && (tts.done || tts.error)", 120, "speech in the saved voice")
    state = page.eval("({error: tts.error, mode: tts.mode, bytes: tts.bytes, seconds: tts.scheduledSeconds})")
    assert state["error"] == "" and state["mode"] == "webaudio" and state["seconds"] > 0, state
    delete_voice(page, "file-voice")
    assert saved_names(page)["server"] == []
    assert page.eval("document.getElementById('cloneStatus').textContent") == 'Deleted "file-voice".'


def test_use_once_speaks_in_the_recording_and_saves_nothing(page: DevToolsPage) -> None:
    choose_file(page, PROMPT)
    choose(page, "wav")
    run = int(page.eval("tts.runs")) + 1
    click(page, "#useOnce")
    page.wait_for(f"tts.runs === {run} && (tts.done || tts.error)", 120, "speech in the one-off voice")
    state = page.eval("({error: tts.error, mode: tts.mode, bytes: tts.bytes, seconds: tts.scheduledSeconds})")
    assert state["error"] == "" and state["mode"] == "webaudio" and state["seconds"] > 0, state
    assert state["seconds"] == pytest.approx((state["bytes"] - 44) / 2 / 22050, abs=0.01)
    assert page.eval("document.getElementById('download').download") == "speech.wav"
    names = saved_names(page)
    assert names["server"] == [] and names["list"] == [], names


def test_a_file_that_is_not_audio_shows_the_server_error(page: DevToolsPage, tmp_path: Path) -> None:
    bad = tmp_path / "notes.wav"
    bad.write_text("this is not a recording\n" * 20)
    choose_file(page, bad)
    message = save_voice(page, "bad-voice")
    assert not message.startswith(("HTTP ", "Saved")), f"the JSON error body was not used: {message}"
    assert "audio" in message and "(" in message, message  # the server's message and its code
    assert saved_names(page)["server"] == []


def test_bad_names_are_refused_with_the_server_message(page: DevToolsPage) -> None:
    choose_file(page, PROMPT)
    message = save_voice(page, "-bad name")
    assert not message.startswith(("HTTP ", "Saved")) and "name" in message, message
    assert saved_names(page)["server"] == []


def test_a_name_in_use_is_refused_with_the_server_message(page: DevToolsPage) -> None:
    choose_file(page, PROMPT)
    assert save_voice(page, "twice").startswith('Saved "twice"')
    message = save_voice(page, "twice")
    assert "twice" in message and message.endswith("(voice_exists)"), message
    assert saved_names(page)["list"] == ["twice"]
    delete_voice(page, "twice")


def test_microphone_recording_is_saved_as_a_voice(page: DevToolsPage, repo_root: Path) -> None:
    """Chromium's fake microphone: MediaRecorder gives audio/webm;codecs=opus, and the server decodes it as it is."""
    click(page, "#record")
    page.wait_for("clone.recorder && clone.recordedS > 2", 20, "two seconds of recording")
    assert page.eval("document.getElementById('saveVoice').disabled && document.getElementById('useOnce').disabled")
    assert page.eval("document.getElementById('recTime').textContent").endswith(" s / 30 s")
    click(page, "#record")  # stop
    page.wait_for("!clone.recorder && clone.prompt && clone.prompt.filename === 'recording.webm'", 10, "the recording")
    assert "webm" in page.eval("clone.prompt.blob.type")
    assert page.eval("document.getElementById('promptFile').value") == "", "the picker still names the earlier file"
    status = save_voice(page, "mic-voice")
    assert status.startswith('Saved "mic-voice"'), status
    page.eval("document.getElementById('cloning').scrollIntoView()")
    page.screenshot(repo_root / "test-artifacts" / "browser-recording.png")
    delete_voice(page, "mic-voice")


def test_recording_stops_by_itself_at_the_limit(page: DevToolsPage) -> None:
    page.eval("clone.maxRecordS = 1.5")  # the page's 30 s, shortened so the test does not wait half a minute
    try:
        page.eval("clone.setPrompt(null)")
        click(page, "#record")
        page.wait_for("clone.prompt && !clone.recorder", 10, "the recording to stop by itself")
        assert 1.2 <= page.eval("clone.recordedS") <= 1.6
        assert page.eval("document.getElementById('record').textContent") == "Record"
    finally:
        page.eval("clone.maxRecordS = 30")


def type_into(page: DevToolsPage, element_id: str, text: str) -> None:
    """Focus an input and type as a user does (DevTools Input.insertText fires the `input` events)."""
    page.eval(f"document.getElementById({element_id!r}).focus()")
    page.send("Input.insertText", text=text)


CAPTURE_FORMS = """(() => {
    window.sentForms = [];
    if (window.fetchBeforeCapture) return;
    window.fetchBeforeCapture = window.fetch;
    window.fetch = (url, options) => {
        if (options && options.body instanceof FormData) {
            window.sentForms.push(Object.fromEntries([...options.body.entries()].filter(([, v]) => typeof v === 'string')));
        }
        return window.fetchBeforeCapture(url, options);
    };
})()"""


def test_a_new_recording_does_not_keep_the_previous_transcript(page: DevToolsPage) -> None:
    """The transcript belongs to the recording it was typed for: a new one starts without it, and Use once sends
    none (was: the file's transcript went out with the microphone recording, a zero-shot clone on wrong words)."""
    choose_file(page, PROMPT)
    type_into(page, "transcript", "希望你以后能够做的比我还好呦。")
    click(page, "#record")
    page.wait_for("clone.recorder && clone.recordedS > 1", 20, "a second of recording")
    click(page, "#record")  # stop
    page.wait_for("!clone.recorder && clone.prompt && clone.prompt.filename === 'recording.webm'", 10, "the recording")
    assert page.eval("document.getElementById('transcript').value") == ""
    page.eval(CAPTURE_FORMS)
    choose(page, "wav")
    run = int(page.eval("tts.runs")) + 1
    click(page, "#useOnce")
    page.wait_for(f"tts.runs === {run} && (tts.done || tts.error)", 120, "speech in the recorded voice")
    assert page.eval("window.sentForms.map(f => f.prompt_text)") == [""]


def test_voice_names_say_language_and_gender(page: DevToolsPage) -> None:
    options = page.eval("[...document.getElementById('voice').options].map(o => [o.value, o.textContent])")
    assert ["中文女", "中文女 — Chinese, female"] in options and ["英文男", "英文男 — English, male"] in options, options
    assert not any(value == "alloy" for value, _ in options), "OpenAI names are other names for the same voices"


def test_a_stale_error_goes_away_while_the_user_edits(page: DevToolsPage) -> None:
    page.eval("""(() => {
        const sel = document.getElementById('voice');
        sel.add(new Option('missing', 'no-such-speaker'));
        sel.value = 'no-such-speaker';
    })()""")
    speak(page, "wav")
    page.wait_for("document.getElementById('error').textContent && !tts.busy", 30, "the server's error")
    type_into(page, "text", "再来一次。")
    assert page.eval("document.getElementById('error').textContent") == ""
    page.eval("document.getElementById('voice').remove(document.getElementById('voice').options.length - 1)")
    choose_file(page, PROMPT)
    assert "name" in save_voice(page, "-bad name")
    type_into(page, "voiceName", "x")
    assert page.eval("document.getElementById('cloneError').textContent") == ""


def test_delete_asks_before_it_deletes(page: DevToolsPage) -> None:
    choose_file(page, PROMPT)
    assert save_voice(page, "keep-me").startswith('Saved "keep-me"')
    click(page, '#savedVoices li[data-id="keep-me"] button[data-role=delete]')
    assert saved_names(page)["server"] == ["keep-me"], "one click deleted the voice"
    assert page.eval("document.querySelector('#savedVoices li[data-id=\"keep-me\"] button[data-role=confirm]') !== null")
    click(page, '#savedVoices li[data-id="keep-me"] button.secondary')  # Keep it
    assert page.eval("document.querySelector('#savedVoices li[data-id=\"keep-me\"] button[data-role=confirm]') === null")
    assert saved_names(page)["server"] == ["keep-me"]
    delete_voice(page, "keep-me")
    assert saved_names(page)["server"] == []


USER_KEY, ADMIN_KEY = "user-key-0123456789", "admin-key-0123456789"


@pytest.fixture(scope="module")
def keyed_voices(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The saved voices of `keyed_app`."""
    return tmp_path_factory.mktemp("browser-keyed-voices")


@pytest.fixture(scope="module")
def keyed_app(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path, keyed_voices: Path) -> Iterator[AppServer]:
    """API keys on (a user key and an admin key), with one saved voice."""
    env = {"TTS_RATE_LIMIT_PER_MINUTE": "0", "TTS_API_KEYS": USER_KEY, "TTS_ADMIN_API_KEYS": ADMIN_KEY}
    env["TTS_VOICES_DIR"] = str(keyed_voices)
    server = AppServer(tmp_path_factory.mktemp("browser-keyed"), tiny_bundle, env, name="keyed")
    server.start()
    with server.client(headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as admin:
        files = {"audio": ("p.wav", PROMPT.read_bytes(), "audio/wav")}
        made = admin.post("/v1/voices", data={"name": "theirs", "transcript": "希望你以后能够做的比我还好呦。"}, files=files)
        assert made.status_code == 201, made.text
    yield server
    server.stop()
    server.dump_log()


@contextmanager
def visiting(page: DevToolsPage, url: str) -> Iterator[DevToolsPage]:
    """The page at `url` for a while, then back at the module's app (loaded again)."""
    back = page.eval("location.href")
    page.navigate(url)
    page.wait_for("window.clone && clone.canManage !== null || document.getElementById('cloneError').textContent", 20, "the page")
    try:
        yield page
    finally:
        page.navigate(back)
        page.wait_for("window.tts && window.tts.voicesLoaded && window.tts.info", 20, "the voice list and /info")


def enter_key(page: DevToolsPage, key: str) -> None:
    page.eval(f"""(() => {{ const k = document.getElementById('apikey'); k.value = {key!r};
        k.dispatchEvent(new Event('change')); }})()""")


def test_use_makes_a_saved_voice_the_one_speak_uses(page: DevToolsPage) -> None:
    choose_file(page, PROMPT)
    assert save_voice(page, "use-me").startswith('Saved "use-me"')
    page.eval("document.getElementById('voice').value = '中文女'")
    click(page, '#savedVoices li[data-id="use-me"] button[data-role=use]')
    assert page.eval("document.getElementById('voice').value") == "use-me"
    assert page.eval("document.getElementById('cloneStatus').textContent") == '"use-me" is the voice now: press Speak.'
    delete_voice(page, "use-me")


def test_keys_the_page_explains_and_delete_only_for_admins(page: DevToolsPage, keyed_app: AppServer) -> None:
    """Without a key: a sentence a person can act on (was: the server's `Authorization: Bearer` hint), saved voices
    by name only, no Delete and no Save. A user key: still no Delete (it would be a 403). An admin key: Delete."""
    item = "document.querySelector('#savedVoices li[data-id=\"theirs\"]')"
    with visiting(page, keyed_app.base_url + "/"):
        assert page.eval(f"{item}.firstChild.textContent") == "theirs", "the details (transcript) need a key"
        assert page.eval(f"{item}.querySelector('button[data-role=delete]') === null"), "Delete offered without a key"
        assert page.eval(f"{item}.querySelector('button[data-role=use]') !== null"), "a usable voice offers Use"
        assert page.eval("!document.getElementById('manageNote').hidden")
        choose_file(page, PROMPT)
        assert page.eval("document.getElementById('saveVoice').disabled")
        speak(page, "wav")
        message = page.wait_for("!tts.busy && document.getElementById('error').textContent", 30, "the refusal")
        assert message == "This server needs an API key: enter it in the “API key” field above.", message
        enter_key(page, USER_KEY)
        page.wait_for(f"{item}.textContent.startsWith('theirs (')", 10, "the details with a key")
        assert page.eval(f"{item}.querySelector('button[data-role=delete]') === null"), "Delete for a key that cannot"
        assert page.eval(f"{item}.querySelector('button[data-role=use]') !== null"), "a usable voice offers Use"
        assert page.eval("document.getElementById('saveVoice').disabled")
        enter_key(page, ADMIN_KEY)
        page.wait_for(f"{item}.querySelector('button[data-role=delete]') !== null", 10, "Delete for an admin key")
        assert page.eval("document.getElementById('manageNote').hidden && !document.getElementById('saveVoice').disabled")


@pytest.fixture(scope="module")
def v2_voices(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The saved voices of `v2_app` (a directory another server may share)."""
    return tmp_path_factory.mktemp("browser-v2-voices")


@pytest.fixture(scope="module")
def v2_app(tmp_path_factory: pytest.TempPathFactory, repo_root: Path, v2_voices: Path) -> Iterator[AppServer]:
    """The committed CosyVoice2 bundle: 24 kHz, no built-in speakers."""
    server = AppServer(tmp_path_factory.mktemp("browser-v2"), repo_root / "models" / "tiny-cosyvoice2",
                       {"TTS_RATE_LIMIT_PER_MINUTE": "0", "TTS_VOICES_DIR": str(v2_voices)}, name="v2")  # fmt: skip
    server.start()
    yield server
    server.stop()
    server.dump_log()


def test_a_model_without_speakers_says_how_to_get_a_voice_then_speaks_a_saved_one(page: DevToolsPage, v2_app: AppServer) -> None:
    """CosyVoice2 as released has no built-in speakers: the voice list says to save one and Speak explains instead of
    sending a request the server would refuse; a saved voice then speaks at the 24 kHz its WAV header names."""
    with visiting(page, v2_app.base_url + "/"):
        page.wait_for("tts.voicesLoaded && tts.info", 20, "the voice list")
        options = page.eval("[...document.getElementById('voice').options].map(o => [o.value, o.textContent])")
        assert options == [["", "no voices yet: save one under Voice cloning"]], options
        run = speak(page, "wav")
        message = page.wait_for("document.getElementById('error').textContent", 10, "the explanation")
        assert message.startswith("This model has no built-in speakers: save a voice"), message
        assert int(page.eval("tts.runs")) == run - 1, "a request was sent without a voice"
        choose_file(page, PROMPT)
        status = save_voice(page, "mine", "希望你以后能够做的比我还好呦。")
        assert status.startswith('Saved "mine"'), status
        assert page.eval("document.getElementById('voice').value") == "mine"
        run = speak(page, "wav")
        page.wait_for(f"tts.runs === {run} && (tts.done || tts.error)", 120, "speech in the saved voice")
        state = page.eval("({error: tts.error, mode: tts.mode, seconds: tts.scheduledSeconds})")
        assert state["error"] == "" and state["mode"] == "webaudio" and state["seconds"] > 0, state
        delete_voice(page, "mine")


def test_a_voice_another_model_made_is_labelled_without_use_and_admins_may_delete_it(
    page: DevToolsPage, v2_app: AppServer, v2_voices: Path, tiny_bundle: Path
) -> None:
    """A CosyVoice-300M server saved `v1-voice` into the store this CosyVoice2 server reads: GET /v1/voices says it is
    not usable here, so the page lists it apart (after the usable ones), says it was made for another model and
    offers no Use; Delete stays for those who may delete, and the stored voice is kept until someone does."""
    v1_settings = Settings(  # type: ignore[call-arg]
        _env_file=None, model_dir=tiny_bundle, voices_dir=v2_voices, intra_op_threads=1, rate_limit_per_minute=0
    )
    with TestClient(create_app(v1_settings)) as v1:
        files = {"audio": ("p.wav", PROMPT.read_bytes(), "audio/wav")}
        assert v1.post("/v1/voices", data={"name": "v1-voice"}, files=files).status_code == 201
    with v2_app.client() as http:
        made = http.post("/v1/voices", data={"name": "v2-voice", "transcript": "希望你以后能够做的比我还好呦。"}, files=files)
        assert made.status_code == 201, made.text
        assert {v["id"]: v["usable"] for v in http.get("/v1/voices").json()["data"]} == {"v1-voice": False, "v2-voice": True}
    stored = sorted(p.name for p in v2_voices.iterdir())
    other, own = (f"document.querySelector('#savedVoices li[data-id=\"{n}\"]')" for n in ("v1-voice", "v2-voice"))
    with visiting(page, v2_app.base_url + "/"):
        page.wait_for(f"!!({other} && {own})", 20, "both saved voices")
        assert saved_names(page)["list"] == ["v2-voice", "v1-voice"], "the other model's voice is not listed apart"
        label = page.eval(f"{other}.querySelector('[data-role=other-model]')?.textContent")
        v1_model = ModelBundle.load(tiny_bundle).manifest.model
        assert label == f" — made for another model ({v1_model}): this server cannot speak it", label
        assert page.eval(f"{other}.classList.contains('other') && {other}.querySelector('button[data-role=use]') === null")
        assert page.eval(f"{other}.querySelector('button[data-role=delete]') !== null"), "an admin may delete it"
        assert page.eval(f"{own}.querySelector('[data-role=other-model]') === null && !{own}.classList.contains('other')")
        assert page.eval(f"{own}.querySelector('button[data-role=use]') !== null")
        assert "v1-voice" not in saved_names(page)["select"]
        assert sorted(p.name for p in v2_voices.iterdir()) == stored, "listing the voice changed the store"
        click(page, '#savedVoices li[data-id="v1-voice"] button[data-role=delete]')
        assert page.eval(f"{other}.querySelector('[data-role=other-model]') !== null"), "the label left while confirming"
        click(page, '#savedVoices li[data-id="v1-voice"] button[data-role=confirm]')
        page.wait_for(f"!{other}", 20, "the deletion")
        delete_voice(page, "v2-voice")
    assert list(v2_voices.iterdir()) == []


def test_the_page_and_the_schema_name_the_served_model(page: DevToolsPage, app: AppServer, v2_app: AppServer) -> None:
    """Names come from the served bundle's manifest: CosyVoice2 is not called CosyVoice-300M-SFT anywhere."""
    for server in (app, v2_app):
        with server.client() as http:
            model = http.get("/info").json()["model"]
            schema = http.get("/openapi.json")
        assert schema.json()["info"]["summary"] == f"{model} text-to-speech on ONNX Runtime (CPU)"
        if server is v2_app:
            assert "CosyVoice-300M-SFT" not in schema.text
        with visiting(page, server.base_url + "/"):
            page.wait_for("tts.info", 20, "/info")
            assert page.eval("document.getElementById('model').textContent") == f"{model} text to speech"
            assert page.eval("document.title") == f"cosyvoice-lite: {model}"
            if server is v2_app:
                assert "300M" not in page.eval("document.body.innerText")


def test_typing_a_key_clears_the_missing_key_error(page: DevToolsPage, keyed_app: AppServer) -> None:
    """The explanation answered the request sent without a key: it goes as soon as a key is typed (no blur needed)."""
    with visiting(page, keyed_app.base_url + "/"):
        speak(page, "wav")
        message = page.wait_for("!tts.busy && document.getElementById('error').textContent", 30, "the refusal")
        assert message.startswith("This server needs an API key"), message
        type_into(page, "apikey", USER_KEY)
        assert page.eval("document.getElementById('error').textContent") == ""


def test_the_key_field_shows_its_whole_placeholder(page: DevToolsPage) -> None:
    fits = page.eval("""(() => {
        const k = document.getElementById('apikey'), st = getComputedStyle(k);
        const ctx = document.createElement('canvas').getContext('2d');
        ctx.font = `${st.fontStyle} ${st.fontWeight} ${st.fontSize} ${st.fontFamily}`;
        const room = k.clientWidth - parseFloat(st.paddingLeft) - parseFloat(st.paddingRight);
        return {text: ctx.measureText(k.placeholder).width, room, placeholder: k.placeholder};
    })()""")
    assert fits["placeholder"] and fits["text"] <= fits["room"], fits


def test_the_page_has_an_icon(page: DevToolsPage, app: AppServer) -> None:
    """The icon the page links and the /favicon.ico browsers ask for by default: an image, not a 404."""
    linked = page.eval("""(async () => {
        const r = await fetch(document.querySelector('link[rel=icon]').href);
        return {status: r.status, type: r.headers.get('content-type'), body: await r.text()};
    })()""")
    assert linked["status"] == 200 and linked["type"] == "image/svg+xml" and linked["body"].startswith("<svg"), linked
    with app.client() as http:
        icon = http.get("/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"


def test_without_a_key_a_voice_another_model_made_is_marked(
    page: DevToolsPage, keyed_app: AppServer, keyed_voices: Path, tiny_v2_bundle: Path
) -> None:
    """Keys on, none entered: the public list has no details, but it says which voices this model cannot speak, so
    a voice a CosyVoice2 server saved into this store is labelled and offers no Use (it does not look usable)."""
    v2_settings = Settings(  # type: ignore[call-arg]
        _env_file=None, model_dir=tiny_v2_bundle, voices_dir=keyed_voices, intra_op_threads=1, rate_limit_per_minute=0
    )
    with TestClient(create_app(v2_settings)) as v2:
        files = {"audio": ("p.wav", PROMPT.read_bytes(), "audio/wav")}
        assert v2.post("/v1/voices", data={"name": "v2-made"}, files=files).status_code == 201
    other, own = (f"document.querySelector('#savedVoices li[data-id=\"{n}\"]')" for n in ("v2-made", "theirs"))
    try:
        with visiting(page, keyed_app.base_url + "/"):
            page.wait_for(f"!!({other} && {own})", 20, "both saved voices")
            assert page.eval(f"{other}.classList.contains('other') && {other}.querySelector('button[data-role=use]') === null")
            note = page.eval(f"{other}.querySelector('[data-role=other-model]')?.textContent")
            assert note == " — made for another model: this server cannot speak it", note
            assert page.eval(f"!{own}.classList.contains('other')")
            assert "v2-made" not in saved_names(page)["select"]
    finally:
        with keyed_app.client(headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as admin:
            assert admin.delete("/v1/voices/v2-made").status_code == 204


def test_a_page_opened_while_the_model_loads_gets_ready_by_itself(
    page: DevToolsPage, tmp_path: Path, tiny_bundle: Path, app: AppServer
) -> None:
    """The server answers while its warm-up is held (a closed gate): the page says the model is loading instead of
    showing errors, and fills its lists once the model is ready."""
    gate = FileGate(tmp_path / "gate")
    env = {"TTS_RATE_LIMIT_PER_MINUTE": "0", "TEST_GATE_CLOSED": "1"}
    loading = AppServer(tmp_path, tiny_bundle, env, name="loading", gate=gate.path)
    try:
        ManagedProcess.start(loading)
        wait_until(lambda: port_open(loading.port) or not loading.alive(), 60, "the server's port")
        page.navigate(loading.base_url + "/")
        status = page.wait_for("document.getElementById('status').textContent", 20, "the loading note")
        assert status == "The model is still loading: the page gets ready by itself.", status
        assert page.eval("document.getElementById('error').textContent + document.getElementById('cloneError').textContent") == ""
        gate.set()
        page.wait_for("tts.voicesLoaded && tts.info && clone.canManage !== null", 60, "the page once the model is ready")
        assert page.eval("document.getElementById('status').textContent") == ""
        assert "中文女" in saved_names(page)["select"]
    finally:
        gate.set()
        page.navigate(app.base_url + "/")
        page.wait_for("window.tts && window.tts.voicesLoaded && window.tts.info", 20, "the voice list and /info")
        loading.stop()
        loading.dump_log()
