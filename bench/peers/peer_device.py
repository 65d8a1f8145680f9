"""Where a PyTorch peer of ferry-bench runs: the --device argument (cpu, cuda or cuda:N), opening
that device, and fp32 without TF32 on CUDA, as ferry computes. Shared by torch_step.py and
torch_gpt.py (Python finds it beside them, installed or in the sources)."""
import argparse
import re
import warnings


def device_arg(text: str) -> str:
    """--device: cpu, cuda or cuda:N."""
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, not '{text}'")
    return text


def open_device(torch, name: str):
    """The torch.device for --device, or an error message when it cannot be used."""
    if name == "cpu":
        return torch.device("cpu"), None
    if not torch.cuda.is_available():
        return None, (f"--device {name}: torch {torch.__version__} has no usable CUDA device "
                      f"(torch.cuda.is_available() is False; built with CUDA {torch.version.cuda})")
    device = torch.device(name)
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        return None, f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible"
    return torch.device("cuda", index), None


def strict_fp32(torch) -> None:
    """No TF32 in CUDA matmuls or cuDNN convolutions (fp32, as ferry computes), set through one API
    only: PyTorch 2.9+ raises on later matmuls when its legacy and new TF32 settings are mixed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 2.9+ warns that the legacy setters will be deprecated
        try:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        except Exception:
            torch.backends.cuda.matmul.fp32_precision = "ieee"
            torch.backends.cudnn.conv.fp32_precision = "ieee"
