"""benchmarks.command_buffers names the custom calls under each `while` / `conditional` of a compiled program that
an XLA command buffer cannot record (a synthetic program's HLO text in XLA's printed form)."""

from benchmarks.command_buffers import control_flow, report

HLO = """HloModule jit__decode_group, entry_computation_layout={()->f32[]}

%fused_add (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %add.0 = f32[4]{0} add(%p0, %p0)
}

%sort (b: f32[4]) -> f32[4] {
  %b = f32[4]{0} parameter(0)
  ROOT %custom-call.3 = f32[4]{0} custom-call(%b), custom_call_target="xla.gpu.ext.cub_sort_pairs"
}

%skip (s: f32[4]) -> f32[4] {
  %s = f32[4]{0} parameter(0)
  ROOT %pallas_call.9 = f32[4]{0} custom-call(%s), custom_call_target="__gpu$xla.gpu.triton"
}

%body (state: (s32[], f32[4])) -> (s32[], f32[4]) {
  %state = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%state), index=1
  %loop_add_fusion = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add
  %pred.1 = pred[] constant(true)
  %conditional.2 = f32[4]{0} conditional(%pred.1, %x, %x), true_computation=%sort, false_computation=%skip
  %i = s32[] get-tuple-element(%state), index=0
  ROOT %tuple.1 = (s32[], f32[4]{0}) tuple(%i, %conditional.2)
}

%cond (c: (s32[], f32[4])) -> pred[] {
  %c = (s32[], f32[4]{0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (a: (s32[], f32[4])) -> (s32[], f32[4]) {
  %a = (s32[], f32[4]{0}) parameter(0)
  %while.5 = (s32[], f32[4]{0}) while(%a), condition=%cond, body=%body
  %conditional.7 = f32[4]{0} conditional(%pred.1, %x, %x), branch_computations={%skip, %skip}
  ROOT %tuple.8 = (s32[], f32[4]{0}) tuple(%while.5)
}
"""


def test_names_the_custom_calls_that_keep_a_loop_on_the_host():
    flows = {flow.name: flow for flow in control_flow(HLO)}
    assert flows["while.5"].blocking == ("custom-call.3: xla.gpu.ext.cub_sort_pairs",)  # through its conditional
    assert flows["conditional.2"].blocking == ("custom-call.3: xla.gpu.ext.cub_sort_pairs",)
    assert flows["conditional.7"].blocking == ()  # Triton calls only
    text = report(HLO)
    assert "conditional conditional.7: recordable" in text
    assert "while while.5: holds custom-call.3: xla.gpu.ext.cub_sort_pairs" in text
