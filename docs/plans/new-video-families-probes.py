"""Probes behind docs/plans/new-video-families.md (§7): throwaway study code, not part of the
project (docs/plans is outside ruff and mypy). Run from the repository root:

    DIFFBATCH_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python docs/plans/new-video-families-probes.py

1. `batching()`: request-level behaviour of the stock pipelines (prompt lists, n, VACE refusals,
   what the server loads today).
2. `wan22()`: Wan 2.2 A14B stepped by hand, two requests whose expert switches fall at different
   iterations sharing each iteration (one forward per expert), each compared with its stock run.
3. `ti2v()`: a TI2V text-to-video and an image-to-video request in ONE forward per step, with
   per-token timesteps, each compared with its stock run.
4. `vace_scale()`: a per-row `control_hidden_states_scale` of shape (layers, rows, 1, 1).
5. `timing()`: the table of §7 (parameters, disk, build and call times).
"""

import copy
import numpy as np, torch
from PIL import Image
from diffusers import DiffusionPipeline, WanImageToVideoPipeline
from pipelines.tiny import tiny_model_dir
torch.set_num_threads(2)
S = dict(height=32, width=32, num_frames=9)

def load(n):
    p = DiffusionPipeline.from_pretrained(tiny_model_dir(n)); p.set_progress_bar_config(disable=True); return p

def decode(pipe, latents):
    vae = pipe.vae; shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape); std = torch.tensor(vae.config.latents_std).view(shape)
    return pipe.video_processor.postprocess_video(vae.decode(latents * std + mean, return_dict=False)[0], output_type="np")

@torch.no_grad()
def wan22():
    pipe = load("tiny-wan22")
    boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
    reqs = [dict(prompt="a cat", steps=4, g=4.0, g2=3.0, seed=0), dict(prompt="a dog", steps=7, g=5.0, g2=2.0, seed=1)]
    states = []
    for r in reqs:
        cond, uncond = pipe.encode_prompt(r["prompt"], "", do_classifier_free_guidance=True, max_sequence_length=512)
        sched = copy.deepcopy(pipe.scheduler); sched.set_timesteps(r["steps"]); sched.set_begin_index(0)
        lat = pipe.prepare_latents(1, 16, 32, 32, 9, torch.float32, "cpu", torch.Generator().manual_seed(r["seed"]))
        states.append(dict(r=r, cond=cond, uncond=uncond, sched=sched, lat=lat, i=0))
    mixed = 0
    while any(s["i"] < s["r"]["steps"] for s in states):
        live = [s for s in states if s["i"] < s["r"]["steps"]]
        groups = {}
        for s in live:
            t = s["sched"].timesteps[s["i"]]
            groups.setdefault(1 if t >= boundary else 2, []).append(s)
        mixed += len(groups) == 2
        preds = {}
        for expert, group in groups.items():  # one forward per expert, then commit all
            model = pipe.transformer if expert == 1 else pipe.transformer_2
            x = torch.cat([s["lat"] for s in group for _ in (0, 1)])
            t = torch.stack([s["sched"].timesteps[s["i"]] for s in group for _ in (0, 1)])
            e = torch.cat([c for s in group for c in (s["uncond"], s["cond"])])
            out = model(hidden_states=x, timestep=t, encoder_hidden_states=e, return_dict=False)[0]
            for k, s in enumerate(group):
                u, c = out[2 * k : 2 * k + 1], out[2 * k + 1 : 2 * k + 2]
                scale = s["r"]["g"] if expert == 1 else s["r"]["g2"]
                preds[id(s)] = u + scale * (c - u)
        for s in live:
            s["lat"] = s["sched"].step(preds[id(s)], s["sched"].timesteps[s["i"]], s["lat"], return_dict=False)[0]
            s["i"] += 1
    for s in states:
        r = s["r"]
        stock = pipe(prompt=r["prompt"], negative_prompt="", num_inference_steps=r["steps"], guidance_scale=r["g"], guidance_scale_2=r["g2"],
                     generator=torch.Generator().manual_seed(r["seed"]), **S).frames
        switch = [int(t < boundary) for t in s["sched"].timesteps].index(1)
        print(f"wan22 {r['steps']} steps (expert 2 from step {switch}): stepped vs stock max diff {np.abs(decode(pipe, s['lat']) - stock).max():.2e}")
    print("wan22 iterations with both experts:", mixed)

@torch.no_grad()
def ti2v():
    pipe = load("tiny-wan22-ti2v"); i2v = WanImageToVideoPipeline.from_pipe(pipe)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    steps = 3
    rows = []
    for kind, seed in (("t2v", 0), ("i2v", 1)):
        cond, uncond = pipe.encode_prompt("a cat", "", do_classifier_free_guidance=True, max_sequence_length=512)
        sched = copy.deepcopy(pipe.scheduler); sched.set_timesteps(steps); sched.set_begin_index(0)
        g = torch.Generator().manual_seed(seed)
        if kind == "t2v":
            lat = pipe.prepare_latents(1, 48, 32, 32, 9, torch.float32, "cpu", g); condition = torch.zeros_like(lat[:, :, :1]); m = torch.ones(1, 1, *lat.shape[2:])
        else:
            px = i2v.video_processor.preprocess(image, height=32, width=32).to(torch.float32)
            lat, condition, m = i2v.prepare_latents(px, 1, 48, 32, 32, 9, torch.float32, "cpu", [g])
        rows.append(dict(kind=kind, seed=seed, cond=cond, uncond=uncond, sched=sched, lat=lat, condition=condition, m=m))
    for i in range(steps):  # both requests in ONE forward each step
        x = torch.cat([(1 - r["m"]) * r["condition"] + r["m"] * r["lat"] for r in rows for _ in (0, 1)])
        ts = torch.cat([(r["m"][0][0][:, ::2, ::2] * r["sched"].timesteps[i]).flatten()[None] for r in rows for _ in (0, 1)])
        e = torch.cat([c for r in rows for c in (r["uncond"], r["cond"])])
        out = pipe.transformer(hidden_states=x, timestep=ts, encoder_hidden_states=e, return_dict=False)[0]
        for k, r in enumerate(rows):
            u, c = out[2 * k : 2 * k + 1], out[2 * k + 1 : 2 * k + 2]
            r["lat"] = r["sched"].step(u + 5.0 * (c - u), r["sched"].timesteps[i], r["lat"], return_dict=False)[0]
    for r in rows:
        lat = (1 - r["m"]) * r["condition"] + r["m"] * r["lat"]
        kw = dict(prompt="a cat", negative_prompt="", num_inference_steps=steps, guidance_scale=5.0, generator=[torch.Generator().manual_seed(r["seed"])], **S)
        stock = (pipe(**kw) if r["kind"] == "t2v" else i2v(image=image, **kw)).frames
        print(f"ti2v {r['kind']} in a shared forward vs stock max diff {np.abs(decode(pipe, lat) - stock).max():.2e}")



def g(s):
    return torch.Generator().manual_seed(s)


def batching():
    # 1, 2: HunyuanVideo 1.5 t2v: n=2, and two prompts batched vs alone
    h = load("tiny-hunyuan-video15")
    try:
        h.vae.enable_slicing()
        out = h(prompt="a cat", num_videos_per_prompt=2, generator=[g(0), g(1)], num_inference_steps=2, **S).frames
        print("hunyuan n=2 ok", np.asarray(out).shape)
    except Exception as e:
        print("hunyuan n=2 fails:", type(e).__name__, str(e)[:200])
    h.vae.enable_slicing()  # the VAE attention fails on batches > 1
    both = np.asarray(h(prompt=["a cat", "a dog"], generator=[g(0), g(1)], num_inference_steps=2, **S).frames)
    alone = [np.asarray(h(prompt=p, generator=[g(s)], num_inference_steps=2, **S).frames)[0] for p, s in (("a cat", 0), ("a dog", 1))]
    print("hunyuan batched vs alone max diff", max(np.abs(both[i] - alone[i]).max() for i in range(2)))
    # 3, 5: Wan 2.2 A14B
    w = load("tiny-wan22")
    both = np.asarray(w(prompt=["a cat", "a dog"], generator=[g(0), g(1)], num_inference_steps=4, **S).frames)
    alone = [np.asarray(w(prompt=p, generator=[g(s)], num_inference_steps=4, **S).frames)[0] for p, s in (("a cat", 0), ("a dog", 1))]
    print("wan22 batched vs alone max diff", max(np.abs(both[i] - alone[i]).max() for i in range(2)))
    a = np.asarray(w(prompt="a cat", generator=g(0), num_inference_steps=4, guidance_scale=1.0, guidance_scale_2=5.0, **S).frames)
    b = np.asarray(w(prompt="a cat", generator=g(0), num_inference_steps=4, guidance_scale=1.0, guidance_scale_2=1.0, **S).frames)
    print("wan22 guidance 1 / guidance_2 5 vs 1/1 max diff", np.abs(a - b).max())
    # 4: VACE with two prompts, and with a list of generators
    v = load("tiny-wan-vace")
    for kw in ({"prompt": ["a cat", "a dog"], "generator": g(0)}, {"prompt": "a cat", "generator": [g(0)]}):
        try:
            v(num_inference_steps=2, **S, **kw); print("vace ok", list(kw))
        except Exception as e:
            print("vace", {k: type(x).__name__ for k, x in kw.items()}, "fails:", type(e).__name__, str(e)[:160])
    # 7: the server today
    from pipelines.base import PipelineConfig
    from pipelines.registry import load_pipeline
    for n in ("tiny-wan22", "tiny-wan22-i2v", "tiny-wan22-ti2v", "tiny-wan-vace", "tiny-hunyuan-video15"):
        try:
            p = load_pipeline(PipelineConfig(model=n)); print(n, "loads as", type(p).__name__, "step batch", p.supports_step_batch)
        except Exception as e:
            print(n, "does not load:", type(e).__name__, str(e)[:150])


def vace_scale():
    pipe = DiffusionPipeline.from_pretrained(tiny_model_dir("tiny-wan-vace"))
    tr = pipe.transformer
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 3, 4, 4, generator=g); ctrl = torch.randn(2, 96, 3, 4, 4, generator=g)
    e = torch.randn(2, 512, 32, generator=g); t = torch.tensor([900.0, 500.0])
    scales = [torch.tensor([1.0, 0.5]), torch.tensor([0.2, 0.0])]
    with torch.no_grad():
        alone = [tr(hidden_states=x[i:i+1], timestep=t[i:i+1], encoder_hidden_states=e[i:i+1], control_hidden_states=ctrl[i:i+1],
                    control_hidden_states_scale=scales[i], return_dict=False)[0] for i in range(2)]
        per_row = torch.stack(scales, dim=1)[:, :, None, None]  # (layers, rows, 1, 1)
        both = tr(hidden_states=x, timestep=t, encoder_hidden_states=e, control_hidden_states=ctrl, control_hidden_states_scale=per_row, return_dict=False)[0]
    print("vace per-row scale (L, B, 1, 1) vs alone max diff", max((both[i:i+1] - alone[i]).abs().max().item() for i in range(2)))


def timing(names=("tiny-wan", "tiny-wan22", "tiny-wan22-i2v", "tiny-wan22-ti2v", "tiny-hunyuan-video15",
                  "tiny-hunyuan-video15-i2v", "tiny-wan-vace")):
    """Build time, parameters, disk size and the median 2-step 9x32x32 call of each model."""
    import statistics, tempfile, time
    from pathlib import Path
    from pipelines.tiny import TINY_MODELS
    root = Path(tempfile.mkdtemp())
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    for name in names:
        d = root / name
        t = time.perf_counter(); TINY_MODELS[name].build(d); build = time.perf_counter() - t
        size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        pipe = DiffusionPipeline.from_pretrained(d); pipe.set_progress_bar_config(disable=True)
        params = sum(p.numel() for c in pipe.components.values() if isinstance(c, torch.nn.Module) for p in c.parameters())
        cls = type(pipe).__name__
        kw = {"prompt": "a cat", "num_frames": 9, "num_inference_steps": 2}
        if "ImageToVideo" in cls: kw["image"] = img
        if cls != "HunyuanVideo15ImageToVideoPipeline": kw.update(height=32, width=32)
        if cls == "WanVACEPipeline": kw.update(video=[img] * 9)
        times = []
        for seed in range(3):
            t = time.perf_counter(); pipe(generator=torch.Generator().manual_seed(seed), **kw); times.append(time.perf_counter() - t)
        print(f"{name:26s} {cls:36s} params {params/1e6:6.3f}M disk {size/1e6:5.1f}MB build {build:4.2f}s call {statistics.median(times):5.2f}s (min {min(times):.2f})", flush=True)


if __name__ == "__main__":
    batching()
    wan22()
    ti2v()
    vace_scale()
    timing()
