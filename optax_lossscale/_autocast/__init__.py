"""The compute policy: `autocast`, op-level mixed precision for any JAX
function (the other half of mixed precision, beside the loss scaler).

One module per concept: `policy` (the policy and the checks of its
arguments), `table` (which primitive runs in which dtype, and why),
`values` (dtypes, casts, and the program's constants), `scopes`
(`keep_float32` matching), `interpreter` (the jaxpr evaluated under the
policy), `control` (calls, loops, branches, remat, `shard_map`),
`arguments` (traced leaves, static leaves, Flax NNX state), `records`
(which policies a trace applied, for the overflow finder) and `transform`
(`autocast` itself).

This floor imports only `_jaxpr` and public jax; `_core`, `_access` and
`_diagnostics` are not imported here.
"""

from optax_lossscale._autocast.policy import Policy as Policy
from optax_lossscale._autocast.records import recording as recording
from optax_lossscale._autocast.transform import autocast as autocast
