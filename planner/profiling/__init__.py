"""`plan profile`: measure this machine (compute rates, overheads, links, memory, a model's timing) and
write a calibration file for `plan --calibration` (costmodel.calibration reads it)."""
