"""Parallelism: functions that wrap a model for the current world; `parallelize()` fixes the order.

Import from the modules (`meshrun.parallel.parallelize`, `meshrun.parallel.resolve`, ...): the
package itself imports nothing, so the layout rules (`resolve`, used by config validation) load
without torch.
"""
