"""API keys (serve/auth.py): ``--api-keys-file`` beside ``--api-key``, and keys that own what they create.

A live app (over the shared reliability engine: one tiny model of every HTTP kind) with a keys file of
three keys (alice twice, under one name, and bob) plus ``--api-key`` (carol), through the real
``openai`` client: another key's video jobs and url files answer 404 and are not listed; keys are
compared in constant time and never reach a log, an error message or a repr.
"""

import logging

import httpx
import openai
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.exceptions import InvalidStatus

from serve import auth as auth_module
from serve.app import ServeSettings, create_app
from serve.auth import ApiKeyConfigError, KeyRing, read_keys_file
from serve.cli import main as cli_main
from serve.server import free_port
from serve_helpers import assert_error, serve_app

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks the video API deprecated

ALICE, ALICE_NEW, BOB, CAROL = "ka-alice-7f3e9c21", "ka-alice-rotated-55d1", "kb-bob-0c4a86e2", "kc-carol-93b7d0f4"
KEYS_FILE = f"""# the team's keys: KEY [NAME]
{ALICE} alice
{ALICE_NEW}  alice   # alice's next key: the same name, so the same owner

{BOB} bob
"""
SECRETS = (ALICE, ALICE_NEW, BOB, CAROL)
FAST = {"num_inference_steps": 2}


def serve_keyed(app):
    """``app`` on a free loopback port; uvicorn leaves logging alone (its records reach the root logger)."""
    return serve_app(app, log_config=None, log_level="debug", access_log=True)


@pytest.fixture(scope="module")
def keyed(reliability_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    (folder / "keys").write_text(KEYS_FILE)
    settings = ServeSettings(api_key=CAROL, api_keys_file=str(folder / "keys"), video_dir=str(folder / "videos"),
                             max_steps=8)
    app = create_app(reliability_server.engine, settings, owns_engine=False)
    try:
        with serve_keyed(app) as url:
            yield url, app
    finally:
        app.state.videos.close()


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_a_key_s_video_jobs_and_files_are_its_own(keyed):
    url, _ = keyed
    a, a2, b, c = (client(url, k) for k in (ALICE, ALICE_NEW, BOB, CAROL))
    video = a.videos.create_and_poll(prompt="waves", model="vid", extra_body=FAST, poll_interval_ms=50)
    assert video.status == "completed"
    image = a.images.generate(prompt="a cat", model="img", response_format="url", extra_body=FAST)
    file_url = image.data[0].url
    own = httpx.get(file_url, headers={"Authorization": f"Bearer {ALICE}"})
    assert own.status_code == 200 and own.content.startswith(b"\x89PNG")
    mp4 = a.videos.download_content(video.id).read()
    assert len(mp4) > 0

    for other in (b, c):  # bob (from the file) and carol (--api-key): as if A's job and file did not exist
        with pytest.raises(openai.NotFoundError):
            other.videos.retrieve(video.id)
        with pytest.raises(openai.NotFoundError):
            other.videos.download_content(video.id)
        with pytest.raises(openai.NotFoundError):
            other.videos.delete(video.id)
        assert video.id not in [v.id for v in other.videos.list(limit=100).data]
        # A's job as a cursor: the same 400 as an id that never existed (nothing says it exists)
        with pytest.raises(openai.BadRequestError) as theirs_after:
            other.videos.list(after=video.id)
        with pytest.raises(openai.BadRequestError) as no_after:
            other.videos.list(after="video_" + "0" * 32)
        assert theirs_after.value.body["message"].replace(video.id, "ID") == \
            no_after.value.body["message"].replace("video_" + "0" * 32, "ID")
        key = BOB if other is b else CAROL
        theirs = httpx.get(file_url, headers={"Authorization": f"Bearer {key}"})
        missing = httpx.get(file_url[:-4] + "zzzz", headers={"Authorization": f"Bearer {key}"})
        assert_error(theirs, 404, "file_id", "file_not_found")
        assert_error(missing, 404, "file_id", "file_not_found")  # the same answer as for no file at all
        file_id = file_url.rsplit("/", 1)[1]
        with pytest.raises(openai.NotFoundError):  # nor may another key read it at OpenAI's path, or delete it
            other.files.content(file_id)
        with pytest.raises(openai.NotFoundError):
            other.files.delete(file_id)

    # A still has all of it (B's delete deleted nothing); alice's other key (the same NAME) too
    for mine in (a, a2):
        assert mine.videos.retrieve(video.id).status == "completed"
        assert mine.videos.download_content(video.id).read() == mp4
        assert video.id in [v.id for v in mine.videos.list(limit=100).data]
    assert httpx.get(file_url, headers={"Authorization": f"Bearer {ALICE_NEW}"}).content == own.content

    # B's own job is B's: listed for B, not for A
    theirs = b.videos.create(prompt="rain", model="vid", extra_body=FAST)
    assert [v.id for v in b.videos.list(limit=100).data] == [theirs.id]
    assert theirs.id not in [v.id for v in a.videos.list(limit=100).data]
    with pytest.raises(openai.NotFoundError):
        a.videos.delete(theirs.id)
    assert b.videos.delete(theirs.id).deleted
    assert a.videos.delete(video.id).deleted
    with pytest.raises(openai.NotFoundError):
        a2.videos.retrieve(video.id)


def test_every_key_of_the_union_is_accepted_and_others_refused(keyed):
    url, _ = keyed
    for key in SECRETS:
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    for header in ({}, {"Authorization": f"Bearer {ALICE[:-1]}"}, {"Authorization": f"Bearer {ALICE}x"},
                   {"Authorization": ALICE}, {"Authorization": f"Bearer {ALICE} alice"}):
        assert_error(httpx.get(f"{url}/v1/models", headers=header), 401, code="invalid_api_key")
    assert httpx.get(f"{url}/health").status_code == 200


def test_the_robot_socket_takes_the_same_keys(keyed):
    """Any key of the file opens the handshake (here refused further on: this server has no policy, 4xx
    naming the model, not 401); a key that is not there gets 401."""
    url, _ = keyed
    ws = url.replace("http", "ws") + "/v1/realtime/robot/openpi"
    for key, accepted in ((BOB, True), (CAROL, True), ("kb-bob-0c4a86e3", False), (None, False)):
        with pytest.raises(InvalidStatus) as e:
            WebsocketClientPolicy(ws, api_key=key)
        assert (e.value.response.status_code != 401) == accepted, (key, e.value.response.status_code)


def test_keys_are_compared_in_constant_time_over_every_key(keyed, monkeypatch):
    """A request is compared with every key, whichever matches (no early exit), by hmac.compare_digest."""
    url, app = keyed
    compared = []
    real = auth_module.hmac.compare_digest
    monkeypatch.setattr(auth_module.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    for key in (ALICE, BOB, CAROL, "nobody"):
        compared.clear()
        httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert sorted(compared) == sorted(b"Bearer " + k.encode() for k in SECRETS)


def test_no_key_reaches_a_log_an_error_or_a_repr(keyed, caplog):
    url, app = keyed
    caplog.set_level(logging.DEBUG)
    bodies = []
    for key in SECRETS:
        auth = {"Authorization": f"Bearer {key}"}
        bodies.append(httpx.post(f"{url}/v1/images/generations", headers=auth,
                                 json={"prompt": "x", "model": "img", **FAST}).text)
        bodies.append(httpx.post(f"{url}/v1/images/generations", headers=auth, json={"prompt": 3}).text)  # 400
        bodies.append(httpx.get(f"{url}/v1/videos/video_{'0' * 32}", headers=auth).text)  # 404
        bodies.append(httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}z"}).text)  # 401
        bodies.append(httpx.get(f"{url}/v1/models", headers={"Authorization": key}).text)  # 401
    seen = caplog.text + "".join(bodies) + repr(app.state.settings) + repr(app.state.keys)
    seen += repr(app.state.keys.keys) + "".join(str(k) for k in app.state.keys.keys)
    assert "GET /v1/models" in caplog.text  # the access log was captured
    for key in SECRETS:
        assert key not in seen


def test_keys_file_lines_and_names(tmp_path):
    path = tmp_path / "keys"
    path.write_text("\n# comment\n  # indented comment\nk1\nk2 the  ops team # note\nk#3\tci\n")
    keys = read_keys_file(str(path))
    assert [(k.secret, k.name, k.owner) for k in keys] == [
        (b"k1", "line 4", "line:4"), (b"k2", "the ops team", "name:the ops team"), (b"k#3", "ci", "name:ci")]
    union = KeyRing.from_settings(ServeSettings(api_key="k0", api_keys_file=str(path)))
    assert [k.owner for k in union.keys] == ["flag:--api-key", "line:4", "name:the ops team", "name:ci"]
    assert KeyRing.from_settings(ServeSettings()) is None


@pytest.mark.parametrize("text, message", [
    ("good-key-1\nbad-kéy-2 x\n",
     " line 2: a key must be printable ASCII without spaces (found the character U+00E9)"),
    ("dup-key-1 a\n# c\ndup-key-1 b\n", " line 3: the same key as line 1"),
    ("# nothing but comments\n\n", ": holds no key"),
    ("flag-key-9 a\n", " line 1: the same key as --api-key"),
])
def test_a_bad_keys_file_names_the_file_and_line_never_the_key(tmp_path, text, message):
    path = tmp_path / "team-keys.txt"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ApiKeyConfigError) as e:
        KeyRing.from_settings(ServeSettings(api_key="flag-key-9", api_keys_file=str(path)))
    assert str(e.value).startswith(f"--api-keys-file {path}{message}")
    for secret in ("good-key-1", "bad-kéy-2", "dup-key-1", "flag-key-9"):
        assert secret not in str(e.value)


def test_the_cli_refuses_a_bad_keys_file_before_loading_a_model(tmp_path, capsys, monkeypatch):
    path = tmp_path / "keys"
    path.write_text("ok-key-1 a\nok-key-1 b\n")

    def no_start(*args, **kwargs):
        raise AssertionError("an engine or Ray started before the keys file was checked")

    for name in ("dit_core.dtype_auto", "dit_core.compile"):  # main() sets up the CLI's loggers: undo after
        logger = logging.getLogger(name)
        for attr in ("handlers", "propagate", "level"):
            monkeypatch.setattr(logger, attr, list(logger.handlers) if attr == "handlers" else getattr(logger, attr))
    monkeypatch.setattr("serve.server.serve", no_start)
    monkeypatch.setattr("serve.ray_flags.serve_on_ray", no_start)
    code = cli_main(["serve", "--port", str(free_port()), "--api-keys-file", str(path), "--replicas", "1"])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err == f"omnidit: error: --api-keys-file {path} line 2: the same key as line 1 (one key, one line)\n"


def test_a_missing_keys_file_is_an_error(tmp_path):
    with pytest.raises(ApiKeyConfigError, match=r"--api-keys-file .*nope: no such file"):
        create_app(None, ServeSettings(api_keys_file=str(tmp_path / "nope")))
    with pytest.raises(ApiKeyConfigError, match="--api-key: a key must be printable ASCII"):
        KeyRing.from_settings(ServeSettings(api_key="two words"))
