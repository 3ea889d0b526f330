"""Qwen-Image: an AR language model's last hidden states condition an MMDiT.

Matches diffusers' QwenImagePipeline: the prompt goes through the chat
template, the language model's last-layer hidden states of the valid tokens
are kept and the template prefix (34 tokens) is dropped. Prompts keep their own
length; a batch pads them and passes the text mask, so prompt length is not
part of the batch key. With ``mixed_sizes`` (the engine's default) the image size is not either: a
step whose rows differ in size runs packed (``qwen_packed``; text without padding there).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_qwenimage import compute_text_seq_len_from_mask

from ar_adapters import PromptError

from ..errors import InvalidParamError
from ..params import SamplingParams
from ..request import Request
from . import qwen_packed
from .base import BlockInputs, TextCond, gather_rows
from .latents import pad_stack
from .packed import PackedFlowFamily
from .processors.qwenimage import QwenImageProcessor

TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TEMPLATE_PREFIX_TOKENS = 34
TOKENIZER_MAX_LENGTH = 1024


class QwenImageFamily(PackedFlowFamily):
    name = "qwenimage"
    pipeline_class = "QwenImagePipeline"
    attention_processor = QwenImageProcessor
    defaults = dict(num_inference_steps=50, true_cfg_scale=4.0, max_sequence_length=512)
    max_text_tokens = 1024
    thinker_component = "text_encoder"
    thinker_max_length = TOKENIZER_MAX_LENGTH + TEMPLATE_PREFIX_TOKENS
    template = TEMPLATE
    # ComfyUI-TeaCache's Qwen-Image polynomial (also vLLM-Omni's default), highest power first
    teacache_coefficients = [-4.5e02, 2.8e02, -4.5e01, 3.2e00, -2.0e-02]
    # image-to-image and inpainting as QwenImageImg2ImgPipeline / QwenImageInpaintPipeline (image_inputs.py)
    params_used = PackedFlowFamily.params_used | {"image", "mask", "strength"}

    def __init__(self, components, dtype, device, checkpoint=None):
        super().__init__(components, dtype, device, checkpoint)
        self.tokenizer = components["tokenizer"]

    @property
    def packable(self) -> bool:
        """Rows of different sizes in one packed forward (``qwen_packed``); not zero_cond_t checkpoints,
        whose blocks modulate by a per-token index the packed loop does not carry."""
        return not self.transformer.zero_cond_t

    def vae_scale_factor(self) -> int:
        return 2 ** len(self.vae.config.temperal_downsample)

    def vae_moments(self, pixels: torch.Tensor) -> torch.Tensor:
        """The video VAE encodes one frame: [N, 3, H, W] -> moments [N, 2z, 1, h, w]."""
        return self.vae.encode(pixels[:, :, None].to(self.vae.dtype)).latent_dist.parameters

    def image_latents(self, sample: torch.Tensor) -> torch.Tensor:
        """Normalized by the VAE's per-channel latents_mean / latents_std, the frame axis dropped."""
        z = self.vae.config.z_dim
        mean = torch.tensor(self.vae.config.latents_mean).view(1, z, 1, 1, 1).to(sample.device, sample.dtype)
        inv_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(1, z, 1, 1, 1).to(sample.device, sample.dtype)
        return ((sample - mean) * inv_std)[:, :, 0]

    def resolve(self, params: SamplingParams) -> SamplingParams:
        params = super().resolve(params)
        if self.transformer.config.guidance_embeds and params.guidance_scale is None:
            params = params.with_defaults(guidance_scale=1.0)
        return params

    def _texts(self, prompt: str, params: SamplingParams) -> list[str]:
        return [TEMPLATE.format(t) for t in [prompt] + ([params.negative_prompt] if self.uses_cfg(params) else [])]

    def validate_prompt(self, prompt: str, params: SamplingParams) -> None:
        super().validate_prompt(prompt, params)
        try:
            self.thinker.check(self._texts(prompt, params))
        except PromptError as e:
            field = "prompt" if not e.index else "negative_prompt"
            raise InvalidParamError(field, prompt if field == "prompt" else params.negative_prompt, str(e)) from None

    def row_tokens(self, prompt: str, params: SamplingParams, inputs=None) -> int:
        longest = max(self.thinker.count_tokens(self._texts(prompt, params)))
        text = min(max(longest - TEMPLATE_PREFIX_TOKENS, 0), params.max_sequence_length)
        return self.latent_tokens(params) + text

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], params: SamplingParams) -> list[TextCond]:
        """The thinker's last hidden states of the templated prompts, template prefix dropped."""
        self.faults.hit("thinker", prompts)
        encoded = self.thinker.encode([TEMPLATE.format(p) for p in prompts])
        # copies, not views: the prompt cache would otherwise keep the template's states too
        return [TextCond(e.hidden[TEMPLATE_PREFIX_TOKENS:][: params.max_sequence_length]
                         .to(self.device, self.dtype, copy=True)) for e in encoded]

    def prepare_positions(self, req: Request, h: int, w: int) -> None:
        req.state["img_shape"] = (1, h, w)

    def transformer_inputs(self, requests: list[Request]) -> dict:
        if self.packs(requests):
            return qwen_packed.packed_inputs(self, requests)
        latents, timesteps, conds, owners = gather_rows(requests)
        embeds, mask = pad_stack([c.embeds for c in conds])
        guidance = self.guidance(owners)
        return dict(hidden_states=latents, timestep=timesteps.to(latents.dtype) / 1000, guidance=guidance,
                    encoder_hidden_states_mask=mask, encoder_hidden_states=embeds,
                    img_shapes=[[requests[0].state["img_shape"]]] * latents.shape[0])

    # The block loop of QwenImageTransformer2DModel.forward (zero_cond_t checkpoints excluded).

    @property
    def num_blocks(self) -> int:
        return len(self.transformer.transformer_blocks)

    def block_inputs(self, inputs: dict) -> BlockInputs:
        if "layout" in inputs:
            return qwen_packed.block_inputs(self, inputs)
        tr = self.transformer
        if tr.zero_cond_t:
            raise ValueError("step caching does not support zero_cond_t Qwen-Image checkpoints")
        img = tr.img_in(inputs["hidden_states"])
        timestep = inputs["timestep"].to(img.dtype)
        txt = tr.txt_in(tr.txt_norm(inputs["encoder_hidden_states"]))
        text_len, _, mask = compute_text_seq_len_from_mask(txt, inputs["encoder_hidden_states_mask"])
        guidance = inputs["guidance"]
        if guidance is None:
            temb = tr.time_text_embed(timestep, img, None)
        else:
            temb = tr.time_text_embed(timestep, guidance.to(img.dtype) * 1000, img, None)
        rotary = tr.pos_embed(inputs["img_shapes"], max_txt_seq_len=text_len, device=img.device)
        return BlockInputs(img, txt, {"temb": temb, "mask": mask}, {"image_rotary_emb": rotary})

    def run_block(self, index: int, x: BlockInputs):
        if x.layout is not None:
            block, backend = self.transformer.transformer_blocks[index], self.attention_backends["joint"]
            if index == self.num_blocks - 1:  # nothing reads the text stream after it
                return qwen_packed.last_block(block, x, backend), None
            return qwen_packed.block(block, x, backend)
        txt, img = self.transformer.transformer_blocks[index](
            hidden_states=x.img, encoder_hidden_states=x.txt, encoder_hidden_states_mask=x.rows["mask"],
            temb=x.rows["temb"], image_rotary_emb=x.shared["image_rotary_emb"])
        return img, txt

    def cache_signal(self, x: BlockInputs) -> torch.Tensor:
        if x.layout is not None:
            return qwen_packed.cache_signal(self, x)
        block = self.transformer.transformer_blocks[0]
        modulation = block.img_mod(x.rows["temb"]).chunk(2, dim=-1)[0]
        return block._modulate(block.img_norm1(x.img), modulation)[0]

    def guide(self, req: Request, cond: torch.Tensor, uncond: torch.Tensor | None) -> torch.Tensor:
        if uncond is None:
            return cond
        combined = uncond + req.params.true_cfg_scale * (cond - uncond)
        # Qwen-Image rescales the guided prediction to the conditional one's norm.
        return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def decode_latents(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        latents = self.unpack(latents, params)[:, :, None].to(self.vae.dtype)
        z = self.vae.config.z_dim
        mean = torch.tensor(self.vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        latents = latents / inv_std + mean
        return self.vae.decode(latents, return_dict=False)[0][:, :, 0]
