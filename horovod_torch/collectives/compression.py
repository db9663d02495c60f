"""Gradient compression applied around an allreduce: compress, reduce, decompress."""
import torch


class Compressor:
    """Interface: compress(tensor) -> (tensor, ctx); decompress(tensor, ctx) -> tensor."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _CastCompressor(Compressor):
    wire_dtype = torch.float16

    @classmethod
    def compress(cls, tensor):
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype != cls.wire_dtype:
            tensor = tensor.to(cls.wire_dtype)
        return tensor, dtype

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor.to(ctx) if ctx is not None and ctx.is_floating_point else tensor


class FP16Compressor(_CastCompressor):
    """Casts floating-point tensors to float16 for the wire, back afterwards."""
    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Casts floating-point tensors to bfloat16 for the wire, back afterwards."""
    wire_dtype = torch.bfloat16


class Compression:
    """The compressors users pass as ``compression=``."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
