"""The Videos API on a live server, through the real ``openai`` client: jobs, MP4 content, list and
delete, failures in ``error``, 400s naming the field, aborting deletes, the bounded job store."""

import io
import time
import warnings

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from dit_core.video import decode_mp4
from helpers import inject_fault
from serve.app import ServeSettings
from test_serve import assert_error, live_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks the video API deprecated

FAST = {"num_inference_steps": 2, "max_sequence_length": 16}


@pytest.fixture(scope="module")
def live(wan_tiny, tmp_path_factory):
    settings = ServeSettings(model_name="tiny-wan", video_dir=str(tmp_path_factory.mktemp("videos")), max_videos=6)
    with live_server(wan_tiny, settings, max_batch_size=8) as srv:
        yield srv


@pytest.fixture
def client(live):
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    yield c
    for video in list(live.app.state.videos.list(100)[0]):  # every test leaves the store empty
        live.app.state.videos.delete(video.id)


def wait_idle(live, timeout=60):
    deadline = time.monotonic() + timeout
    while live.engine.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live.engine.engine.has_unfinished()


def test_create_poll_download_gives_the_requested_frames_and_size(client, live):
    video = client.videos.create_and_poll(prompt="a cat walking", size="48x32", seconds="0.5",
                                          extra_body={**FAST, "fps": 16, "seed": 3}, poll_interval_ms=50)
    assert video.status == "completed" and video.progress == 100 and video.error is None
    assert video.size == "48x32" and video.model == "tiny-wan" and video.completed_at >= video.created_at
    frames = decode_mp4(client.videos.download_content(video.id).read())
    assert frames.shape == (9, 32, 48, 3)  # 0.5 s x 16 fps = 8 frames -> the nearest 4k + 1 is 9
    assert video.seconds == "0.5625"
    # OpenAI's preview variants, through the client: the first frame (WebP), and the frames in a grid (JPEG)
    thumb = Image.open(io.BytesIO(client.videos.download_content(video.id, variant="thumbnail").read()))
    assert thumb.format == "WEBP" and thumb.size == (48, 32)
    assert np.abs(np.asarray(thumb.convert("RGB"), float) - frames[0]).mean() < 6  # (lossy, quality 90)
    sheet = Image.open(io.BytesIO(client.videos.download_content(video.id, variant="spritesheet").read()))
    assert sheet.format == "JPEG" and sheet.size == (3 * 48, 3 * 32)  # 9 frames: 3 x 3
    cells = np.asarray(sheet.convert("RGB"), float).reshape(3, 32, 3, 48, 3).transpose(0, 2, 1, 3, 4).reshape(9, 32, 48, 3)
    assert np.abs(cells - frames).mean(axis=(1, 2, 3)).max() < 8  # frame i in cell i, row by row
    r = httpx.get(f"{live.url}/v1/videos/{video.id}/content", params={"variant": "poster"})
    assert_error(r, 400, "variant")


def test_spritesheets_spread_their_frames_over_the_clip():
    from serve.video_previews import sprite_indices, spritesheet

    assert sprite_indices(9) == list(range(9)) and sprite_indices(81) == [round(i * 80 / 15) for i in range(16)]
    assert sprite_indices(81)[0] == 0 and sprite_indices(81)[-1] == 80
    frames = np.arange(5, dtype=np.uint8)[:, None, None, None] * np.ones((5, 2, 3, 3), np.uint8)
    sheet = np.asarray(spritesheet(frames))
    assert sheet.shape == (2 * 2, 3 * 3, 3)  # 5 frames: 3 columns, 2 rows, the last row short (black)
    assert [sheet[r * 2, c * 3, 0] for r in range(2) for c in range(3)] == [0, 1, 2, 3, 4, 0]


def test_json_body_num_frames_and_sync_mp4(live, client):
    r = httpx.post(live.url + "/v1/videos/sync", json={"prompt": "waves", "size": "32x32", "num_frames": 5,
                                                        "fps": 8, **FAST}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
    assert decode_mp4(r.content).shape == (5, 32, 32, 3) and r.headers["x-num-frames"] == "5"
    job = httpx.post(live.url + "/v1/videos", json={"prompt": "waves", "size": "32x32", "num_frames": 5, **FAST})
    assert job.status_code == 200 and job.json()["status"] in ("queued", "in_progress")
    assert job.json()["seconds"] == "0.3125"  # 5 frames at the model's 16 fps
    # OpenAI's API sends seconds as a string ("4"): in JSON too it is that number
    job = httpx.post(live.url + "/v1/videos", json={"prompt": "waves", "size": "32x32", "seconds": "0.3125", **FAST})
    assert job.status_code == 200 and job.json()["seconds"] == "0.3125", job.text
    wait_idle(live)


def test_a_remix_is_the_source_video_with_the_new_prompt(client, live):
    """OpenAI's videos.remix through the client: a new job with the source's size, frames, fps and seed
    and the new prompt; its frames are those of a fresh create with everything the same but the prompt."""
    opts = {**FAST, "fps": 16, "seed": 5}
    source = client.videos.create_and_poll(prompt="a cat walking", size="32x32", seconds="0.3125", extra_body=opts,
                                           poll_interval_ms=50)
    remix = client.videos.remix(source.id, prompt="a dog running")
    assert remix.remixed_from_video_id == source.id and remix.prompt == "a dog running"
    remix = client.videos.poll(remix.id, poll_interval_ms=50)
    assert remix.status == "completed" and (remix.size, remix.seconds, remix.model) == (source.size, source.seconds,
                                                                                         source.model)
    fresh = client.videos.create_and_poll(prompt="a dog running", size="32x32", seconds="0.3125", extra_body=opts,
                                          poll_interval_ms=50)
    assert fresh.remixed_from_video_id is None
    got, want = (decode_mp4(client.videos.download_content(v.id).read()) for v in (remix, fresh))
    assert got.shape == (5, 32, 32, 3) and np.array_equal(got, want)
    assert not np.array_equal(got, decode_mp4(client.videos.download_content(source.id).read()))  # the prompt counts
    with pytest.raises(openai.NotFoundError):
        client.videos.remix("video_nope", prompt="x")
    assert_error(httpx.post(live.url + f"/v1/videos/{source.id}/remix", json={"prompt": ""}), 400, "prompt")
    assert_error(httpx.post(live.url + f"/v1/videos/{source.id}/remix", json={"prompt": "x", "seed": 1}), 400,
                 "seed", "extra_forbidden")
    wait_idle(live)


def test_content_is_404_until_completed_and_list_paginates(client, live):
    slow = client.videos.create(prompt="a slow one", size="32x32",
                                extra_body={"num_inference_steps": 400, "max_sequence_length": 16})
    with pytest.raises(openai.NotFoundError, match="no content yet"):
        client.videos.download_content(slow.id)
    made = [slow.id] + [client.videos.create(prompt=f"clip {i}", size="32x32", extra_body=FAST).id for i in range(3)]
    page = client.videos.list(limit=2, order="asc")
    assert [v.id for v in page.data] == made[:2] and page.has_more
    assert [v.id for v in page.get_next_page().data] == made[2:]
    assert [v.id for v in client.videos.list(limit=10)] == made[::-1]  # newest first, all pages
    for vid in made:
        assert client.videos.delete(vid).deleted
    assert client.videos.list().data == []
    # a cursor that is gone is an error, not an empty page a client would take for the end
    with pytest.raises(openai.BadRequestError, match="after") as caught:
        client.videos.list(after=made[0])
    assert caught.value.body["param"] == "after"
    err = assert_error(httpx.get(live.url + "/v1/videos", params={"limit": "many"}), 400, "limit")  # as sent
    assert err["message"].startswith("limit: "), err
    wait_idle(live)


def test_delete_aborts_a_running_job_and_frees_its_slot(client, live):
    store = live.app.state.videos
    jobs = [client.videos.create(prompt=f"long {i}", size="32x32",
                                 extra_body={"num_inference_steps": 400, "max_sequence_length": 16})
            for i in range(store.max_jobs)]
    with pytest.raises(openai.RateLimitError) as e:  # the store is full
        client.videos.create(prompt="one more", size="32x32", extra_body=FAST)
    assert e.value.response.headers["retry-after"]
    deadline = time.monotonic() + 30
    while client.videos.retrieve(jobs[0].id).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.videos.delete(jobs[0].id).deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(jobs[0].id)
    ok = client.videos.create_and_poll(prompt="fits now", size="32x32", extra_body=FAST, poll_interval_ms=50)
    for job in jobs[1:]:
        client.videos.delete(job.id)
    wait_idle(live)  # every deleted job left the engine: none ran its 400 steps
    assert ok.status == "completed"
    assert len(store) == 1 and len(list(store.dir.iterdir())) == 1


def test_a_failing_job_reports_its_error(client, live, monkeypatch):
    inject_fault(monkeypatch, live.engine.engine.family, "predict", prompt="boom")
    bad = client.videos.create_and_poll(prompt="boom", size="32x32", extra_body=FAST, poll_interval_ms=50)
    assert bad.status == "failed" and bad.error.code == "generation_failed" and "injected fault" in bad.error.message
    good = client.videos.create_and_poll(prompt="fine", size="32x32", extra_body=FAST, poll_interval_ms=50)
    assert good.status == "completed"


@pytest.mark.parametrize("body,param", [
    ({"num_frames": 8}, "num_frames"),  # Wan makes 4k + 1 frames
    ({"size": "40x32"}, "size"),  # not a multiple of 16
    ({"size": "big"}, "size"),
    ({"seconds": 0}, "seconds"),
    ({"seconds": -2}, "seconds"),
    ({"seconds": 1000}, "seconds"),
    # past the rotary table (64 positions an axis: 253 frames, 1024 pixels a side): once a failed job
    ({"seconds": 20}, "seconds"),
    ({"num_frames": 257}, "num_frames"),
    ({"size": "1040x32"}, "size"),
    ({"seconds": "nan"}, "seconds"),  # (once a 500: the frame count rounded a NaN)
    ({"seconds": "inf"}, "seconds"),
    ({"seconds": "four"}, "seconds"),
    ({"model": "sora-2"}, "model"),
    ({"steps": 3}, "steps"),
    ({"guidance_scale": -1}, "guidance_scale"),
    ({"guidance_scale_2": -1}, "guidance_scale_2"),  # reaches SamplingParams
    ({"guidance_scale_2": 3.0}, "guidance_scale_2"),  # a single-transformer Wan has no second stage
    ({"prompt": ""}, "prompt"),
])
def test_bad_input_is_400_naming_the_field(live, body, param):
    r = httpx.post(live.url + "/v1/videos", json={"prompt": "a cat", "size": "32x32", **FAST, **body})
    assert_error(r, 404 if param == "model" else 400, param)
    r = httpx.post(live.url + "/v1/videos/sync", data={"prompt": "a cat", "size": "32x32", **FAST, **body})
    assert_error(r, 404 if param == "model" else 400, param)


def test_an_unknown_field_lists_the_fields_a_video_takes(live):
    r = httpx.post(live.url + "/v1/videos", json={"prompt": "a cat", "steps": 3})
    err = assert_error(r, 400, "steps", "extra_forbidden")
    assert "not a field of this request" in err["message"], err
    assert {"num_inference_steps", "input_reference", "seconds"} <= set(err["message"].split(": ")[-1].split(", "))


def test_unknown_video_is_404_and_a_file_part_is_refused(client, live):
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_nope")
    r = httpx.post(live.url + "/v1/videos", data={"prompt": "x"}, files={"input_reference": ("a.png", b"123")})
    assert_error(r, 400, "input_reference")


def test_an_image_model_is_refused_by_the_videos_api(tiny_models):
    with live_server(tiny_models["flux"], ServeSettings(model_name="tiny-flux")) as srv:
        r = httpx.post(srv.url + "/v1/videos", json={"prompt": "a cat"})  # the one model makes images
        assert_error(r, 400, "model", "model_not_found")
        assert "no video models" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/videos", json={"prompt": "a cat", "model": "tiny-flux"})
        err = assert_error(r, 400, "model", "wrong_model_kind")
        # where the model goes instead, and that no model here fits this route (not an empty list)
        assert "POST /v1/images/generations takes it; this server has no video models" in err["message"], err


def test_finished_jobs_expire_and_their_files_go(wan_tiny, tmp_path):
    settings = ServeSettings(model_name="w", video_dir=str(tmp_path), video_ttl_s=3)
    with live_server(wan_tiny, settings) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        v = c.videos.create_and_poll(prompt="brief", size="32x32", extra_body=FAST, poll_interval_ms=50)
        assert v.expires_at is not None and len(list(srv.app.state.videos.dir.iterdir())) == 1
        time.sleep(3.2)
        with pytest.raises(openai.NotFoundError):
            c.videos.retrieve(v.id)
        assert list(srv.app.state.videos.dir.iterdir()) == []
        folder = srv.app.state.videos.dir
    assert not folder.exists()  # the store's folder goes with the server
