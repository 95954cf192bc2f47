"""Triton Inference Server: the model-repository writer, the python-backend model it installs, and a launcher
for the tritonserver binary that the nvidia-pytriton wheel ships."""
