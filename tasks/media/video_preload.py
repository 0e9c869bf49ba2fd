"""Imported by the decode pool's fork server for a run that decodes videos (tasks/media/pool.py):
vLLM's video loader, with torch and OpenCV, loaded once there, so every decode process forked
from the server has it from its start."""

from vlm_caption.tasks.media.video import video_loader

video_loader()
