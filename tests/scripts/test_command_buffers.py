"""benchmarks.command_buffers reads which `while` / `conditional` a compiled GPU program runs inside a command
buffer, and names what keeps the others on the host (a synthetic program's HLO text in XLA's printed form)."""

from benchmarks.command_buffers import control_flow, report

HLO = """HloModule jit__decode_group, entry_computation_layout={()->f32[]}

%fused_add (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %add.0 = f32[4]{0} add(%p0, %p0)
}

%command_buffer (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %loop_add_fusion = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_add
}

%sort (b: f32[4]) -> f32[4] {
  %b = f32[4]{0} parameter(0)
  ROOT %custom-call.3 = f32[4]{0} custom-call(%b), custom_call_target="__cub$DeviceRadixSort"
}

%skip (s: f32[4]) -> f32[4] {
  %s = f32[4]{0} parameter(0)
  ROOT %call.9 = f32[4]{0} call(%s), to_apply=%command_buffer
}

%body (state: (s32[], f32[4])) -> (s32[], f32[4]) {
  %state = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%state), index=1
  %call.1 = f32[4]{0} call(%x), to_apply=%command_buffer
  %pred.1 = pred[] constant(true)
  %conditional.2 = f32[4]{0} conditional(%pred.1, %call.1, %call.1), true_computation=%sort, false_computation=%skip
  %i = s32[] get-tuple-element(%state), index=0
  ROOT %tuple.1 = (s32[], f32[4]{0}) tuple(%i, %conditional.2)
}

%cond (c: (s32[], f32[4])) -> pred[] {
  %c = (s32[], f32[4]{0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

%command_buffer.1 (q: (s32[], f32[4])) -> (s32[], f32[4]) {
  %q = (s32[], f32[4]{0}) parameter(0)
  ROOT %while.7 = (s32[], f32[4]{0}) while(%q), condition=%cond, body=%body
}

ENTRY %main (a: (s32[], f32[4])) -> (s32[], f32[4]) {
  %a = (s32[], f32[4]{0}) parameter(0)
  %while.5 = (s32[], f32[4]{0}) while(%a), condition=%cond, body=%body
  ROOT %call.2 = (s32[], f32[4]{0}) call(%while.5), to_apply=%command_buffer.1
}
"""


def test_names_what_keeps_a_loop_on_the_host():
    flows = {flow.name: flow for flow in control_flow(HLO)}
    # %body is called from the entry's while.5 as well as from a command buffer's while.7: it runs on the host
    assert not flows["while.5"].captured and not flows["conditional.2"].captured
    assert flows["while.5"].outside == ("custom-call.3: custom-call __cub$DeviceRadixSort",)
    assert flows["conditional.2"].outside == ("custom-call.3: custom-call __cub$DeviceRadixSort",)
    assert flows["while.7"].captured and flows["while.7"].outside == ()
    text = report(HLO)
    assert "while while.7: in a command buffer" in text and "outside: custom-call.3" in text
