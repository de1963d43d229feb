"""Where captions go besides the WebSocket: archives, live HLS WebVTT, YouTube Live.

Plain logic (cue timing, file formats, the YouTube protocol) lives in one module per
output; `runner` reads the caption Streams from Redis and feeds the sinks; `config`
holds the YAML models and maps them to the plain options used here.
"""
