"""Lossless coding of a run's gradients, updates and moments: evidence that grows with the model, not 16 bytes a
parameter a step.

A case keeps, per step, its gradients, its updates (new - start parameter) and AdamW's two moments, all fp32: 16 bytes
a parameter. Most of those bits are implied by the others: a bf16 engine's gradients are bf16 values, the moments are
AdamW's function of the clipped gradients, the new parameters AdamW's step of the moments. A coded file keeps, for such
a tensor, only what the implication does not give, and reads back the same fp32 bits:

    bf16    the tensor's values are all bf16 values: kept in bf16 (2 bytes), widened on read
    moment  AdamW's moment: the difference of its fp32 bit pattern from a prediction made of this step's gradient
            (grads.safetensors beside it), the clip coefficient of its reported norm and the previous step's moment
    param   an update u = new - start: the new parameter's bit pattern as a difference from AdamW's step of this step's
            moments from the start, the start being the initial parameter (the run's model directory) or the previous
            step's new parameter; u is read back as the fp32 difference new - start, the operation the case made

A difference of bit patterns is an integer, zero where the prediction is exact; it is kept in whichever form is
smallest: nothing (all zero), dense in 8 or 16 bits with the elements that do not fit listed apart, a sparse list, or
all 32 bits. The predictions are fp32 elementwise arithmetic on the CPU, one IEEE operation at a time (correctly
rounded on every CPU), so any machine reads back the same bits; a CRC32 of each predicted tensor's bytes is checked on
read, so a changed start or gradient is an error, never a wrong number. An engine whose optimizer is not AdamW, or
whose moments are not fp32, loses nothing: the difference is then large and kept in 32 bits.

The file's metadata key CODEC_KEY (JSON) lists the logical tensors in order with their shapes and how each is kept;
a file without it is a plain safetensors file (every file written before this format, and every group not coded).

The package's modules, by job: container (the metadata key, format and document), checksum (CRC32 and the CrcMeter a
caller opens to count it), residual (a difference's stored forms), predict (AdamW's arithmetic), encode (writing),
decode (reading: CodedFile) and cache (the DecodeCache a caller opens, decoding(), for what its reads keep between
them). The package holds no state of its own: what a read keeps lies in its caller's DecodeCache, what crc() counts
in its caller's CrcMeter.
"""

from qualify.tensor_codec.cache import (
    DECODED_BYTES,
    DECODED_GPU_SHARE,
    CheckpointIndex,
    DecodeCache,
    decoding,
    held_bytes,
    open_cache,
)
from qualify.tensor_codec.checksum import CRC_CHUNK, CrcMeter, crc, crc32_combine, metering
from qualify.tensor_codec.container import CODEC_KEY, FORMAT, PART, READS, parse
from qualify.tensor_codec.decode import CodedFile
from qualify.tensor_codec.encode import StepCoding, encode_grads, encode_moments, encode_updates, param_coded
from qualify.tensor_codec.predict import Adam, f32, fma, predict_moment, predict_param
from qualify.tensor_codec.residual import residual_from, residual_parts

__all__ = (
    "CODEC_KEY", "CRC_CHUNK", "DECODED_BYTES", "DECODED_GPU_SHARE", "FORMAT", "PART", "READS", "Adam",
    "CheckpointIndex", "CodedFile", "CrcMeter", "DecodeCache", "StepCoding", "crc", "crc32_combine", "decoding",
    "encode_grads", "encode_moments", "encode_updates", "f32", "fma", "held_bytes", "metering", "open_cache",
    "param_coded", "parse", "predict_moment", "predict_param", "residual_from", "residual_parts",
)
