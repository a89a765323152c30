"""megatron-core's pipeline schedules as data: the order each rank runs (schedule), what a
traced run recorded (trace), both as timelines (timeline) and the report ``megatron-ext
schedule`` prints (report). Imports neither recipes nor multimodule: they call it."""
