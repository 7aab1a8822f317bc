"""Checks that the second held-out set's cases hold their bugs, without the recorder:

    python benchmarks/silent_errors/check_heldout2.py

Every case (cases_heldout2.py) runs in both forms, and every healthy loop (healthy_heldout2.py)
once, with a stand-in recorder that keeps references to the model and optimizers and, through a
step pre-hook, each step's largest gradient entry, whether it is finite and the lrs; it records
nothing and checks nothing of gradrepro's. Per case, a line says whether the buggy form shows its
bug and the fixed form does not, with the numbers; a healthy loop must run, stay finite and train.
Exit status 1 if any check fails."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases_heldout2 import CASES  # noqa: E402
from healthy_heldout2 import HEALTHY  # noqa: E402
from stub_check import CHECKS, check_all, check_of, dist, finite_params, moved, same_params  # noqa: E402


@check_of("scheduler_left_on_replaced_optimizer")
def _scheduler_left_on_replaced_optimizer(b, f):
    B, Fx = b[0], f[0]
    lb, lf = B.steps[16]["lrs"][0], Fx.steps[16]["lrs"][0]
    return lb == 0.1 and abs(lf - 0.01) < 1e-12, f"lr at step 16: buggy {lb}, fixed {lf}"


@check_of("finetune_loads_finished_schedule_state")
def _finetune_loads_finished_schedule_state(b, f):
    B, Fx = b[0], f[0]
    lb, lf = {s["lrs"][0] for s in B.steps}, {s["lrs"][0] for s in Fx.steps}
    return lb == {0.0} and lf == {0.05} and dist(B) == 0 and dist(Fx) > 0, \
        f"lrs over the run: buggy {lb}, fixed {lf}; distance moved buggy {dist(B):.3g}, fixed {dist(Fx):.3g}"


@check_of("residual_blocks_by_list_multiplication")
def _residual_blocks_by_list_multiplication(b, f):
    B, Fx = b[0], f[0]
    nb, nf = len(list(B.model.parameters())), len(list(Fx.model.parameters()))
    shared = B.model.blocks[0] is B.model.blocks[2]
    return shared and nb < nf, f"blocks[0] is blocks[2] in buggy: {shared}; parameter tensors buggy {nb}, fixed {nf}"


@check_of("lm_head_only_finetune_with_tied_embedding")
def _lm_head_only_finetune_with_tied_embedding(b, f):
    B, Fx = b[0], f[0]
    eb, ef, hf = moved(B, "embed.weight"), moved(Fx, "embed.weight"), moved(Fx, "head.weight")
    return eb > 0 and ef == 0 and hf > 0, \
        f"embedding moved: buggy {eb:.3g}, fixed {ef:.3g}; fixed head moved {hf:.3g}"


@check_of("rounding_quantiser_without_ste")
def _rounding_quantiser_without_ste(b, f):
    B, Fx = b[0], f[0]
    eb, ef = moved(B, "enc.weight"), moved(Fx, "enc.weight")
    return eb == 0 and ef > 0, f"encoder weight moved: buggy {eb:.3g}, fixed {ef:.3g}"


@check_of("bf16_weights_without_fp32_master")
def _bf16_weights_without_fp32_master(b, f):
    B, Fx = b[0], f[0]
    nb, nf = moved(B, "1.weight"), moved(Fx, "1.weight")
    lb = moved(B, "0.weight")
    return nb == 0 and nf > 0, \
        f"LayerNorm weight moved: buggy {nb:.3g}, fixed {nf:.3g} (buggy first Linear moved {lb:.3g})"


@check_of("scaled_loss_stepped_without_scaler")
def _scaled_loss_stepped_without_scaler(b, f):
    B, Fx = b[0], f[0]
    gb = max(s["gmax"] for s in B.steps)
    gf = max(s["gmax"] for s in Fx.steps)
    fin = finite_params(B)
    return (not fin or gb > 100 * gf) and finite_params(Fx), \
        f"max |grad| at step: buggy {gb:.3g}, fixed (scaled; scaler.step unscales) {gf:.3g}; " \
        f"buggy params finite: {fin}; " \
        f"distance moved buggy {dist(B):.3g}, fixed {dist(Fx):.3g}"


@check_of("accumulated_losses_not_divided")
def _accumulated_losses_not_divided(b, f):
    B, Fx = b[0], f[0]
    r = B.steps[0]["gmax"] / Fx.steps[0]["gmax"]
    return abs(r - 4) < 1e-3, \
        f"max |grad| at the first step, buggy/fixed = {r:.4f}; distance moved buggy {dist(B):.3g}, fixed {dist(Fx):.3g}"


@check_of("validation_pass_in_train_mode")
def _validation_pass_in_train_mode(b, f):
    B, Fx = b[0], f[0]
    rb, rf = B.model[1].running_mean, Fx.model[1].running_mean
    d = float((rb - rf).abs().max())
    return same_params(B, Fx) and d > 0.01, f"weights bit-identical between forms: {same_params(B, Fx)}; " \
        f"max |running_mean buggy - fixed| = {d:.3g}"


@check_of("finetune_in_eval_mode_for_batchnorm")
def _finetune_in_eval_mode_for_batchnorm(b, f):
    B, Fx = b[0], f[0]
    tb, tf = B.model[3].training, Fx.model[3].training
    rb = float(B.model[1].running_mean.abs().max())
    rf = float(Fx.model[1].running_mean.abs().max())
    return (not tb) and tf and rb == 0 and rf == 0, \
        f"dropout.training at the end: buggy {tb}, fixed {tf}; BN running_mean max |.|: buggy {rb}, fixed {rf}"


@check_of("replica_gradients_summed")
def _replica_gradients_summed(b, f):
    B, Fx = b[0], f[0]
    r = B.steps[0]["gmax"] / Fx.steps[0]["gmax"]
    return abs(r - 2) < 1e-3, f"max |grad| at the first step, buggy/fixed = {r:.4f}"


@check_of("replicas_initial_weights_not_broadcast")
def _replicas_initial_weights_not_broadcast(b, f):
    db = max(float((p - q).detach().abs().max()) for p, q in zip(b[0].model.parameters(), b[1].model.parameters()))
    df = max(float((p - q).detach().abs().max()) for p, q in zip(f[0].model.parameters(), f[1].model.parameters()))
    return db > 0 and df == 0, f"max |replica0 - replica1| at the end: buggy {db:.3g}, fixed {df:.3g}"


@check_of("classifier_frozen_by_module_attribute")
def _classifier_frozen_by_module_attribute(b, f):
    B, Fx = b[0], f[0]
    ob, of = moved(B, "outc.weight"), moved(Fx, "outc.weight")
    return ob > 0 and of == 0, f"outc.weight moved: buggy {ob:.3g}, fixed {of:.3g}"


@check_of("auxiliary_loss_returned_as_zero")
def _auxiliary_loss_returned_as_zero(b, f):
    B, Fx = b[0], f[0]
    ab, af = moved(B, "aux.weight"), moved(Fx, "aux.weight")
    gnone = B.model.aux.weight.grad is None
    return ab == 0 and af > 0 and gnone, \
        f"aux.weight moved: buggy {ab:.3g}, fixed {af:.3g}; buggy aux .grad None: {gnone}"


@check_of("attention_mask_passed_as_padding_mask")
def _attention_mask_passed_as_padding_mask(b, f):
    B, Fx = b[0], f[0]
    rows = slice(1, 12)
    eb = float((B.model.embed.weight[rows] - B.init["embed.weight"][rows]).abs().max())
    ef = float((Fx.model.embed.weight[rows] - Fx.init["embed.weight"][rows]).abs().max())
    return eb < 1e-6 and ef > 1e-3, f"real-token embedding rows moved: buggy {eb:.3g}, fixed {ef:.3g}"


@check_of("log_of_softmax_with_outlier")
def _log_of_softmax_with_outlier(b, f):
    B, Fx = b[0], f[0]
    nb = [i for i, s in enumerate(B.steps) if not s["finite"]]
    nf = [i for i, s in enumerate(Fx.steps) if not s["finite"]]
    return nb[:1] == [13] and not nf, f"steps with a non-finite gradient: buggy {nb[:3]}... ({len(nb)}), fixed {nf}; " \
        f"buggy params finite at the end: {finite_params(B)}"


@check_of("ema_buffer_update_into_student")
def _ema_buffer_update_into_student(b, f):
    B, Fx = b[0], f[0]
    d = float((B.model[1].running_mean - Fx.model[1].running_mean).abs().max())
    return same_params(B, Fx) and d > 0, f"student weights bit-identical between forms: {same_params(B, Fx)}; " \
        f"max |student running_mean buggy - fixed| = {d:.3g}"


@check_of("grad_clamp_not_in_place")
def _grad_clamp_not_in_place(b, f):
    B, Fx = b[0], f[0]
    gb, gf = max(s["gmax"] for s in B.steps), max(s["gmax"] for s in Fx.steps)
    return gb > 0.1 and gf <= 0.1 + 1e-6, f"max |grad| at the step: buggy {gb:.3g}, fixed {gf:.3g}"


def main():
    return check_all(CASES, HEALTHY, CHECKS)


if __name__ == "__main__":
    sys.exit(main())
