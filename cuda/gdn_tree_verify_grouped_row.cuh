// One row of the forward substitution of cuda/gdn_tree_verify_grouped.cu (included twice, by both
// layouts of phase 4): node i at level depth d, 4 columns of value head ut. The including code
// defines G6_PIDX(e) (where entry e of the node's pairs is) and G6_PJ(e) (its local ancestor), and
// provides i, d, Xt, Yt, Dt, Ot, bos, hv0, ut, uq, v0, HV, o, delta_out.
{
  float4 ax = make_float4(0.f, 0.f, 0.f, 0.f), ay = ax;
#pragma unroll 4
  for (int e = 0; e < d; ++e) {
    const int j = G6_PJ(e);
    const float xv = Xt[G6_PIDX(e)], yv = Yt[G6_PIDX(e)];
    const float4 dj = *reinterpret_cast<const float4*>(Dt + j * G6_DS);
    ax.x = fmaf(xv, dj.x, ax.x); ax.y = fmaf(xv, dj.y, ax.y); ax.z = fmaf(xv, dj.z, ax.z); ax.w = fmaf(xv, dj.w, ax.w);
    ay.x = fmaf(yv, dj.x, ay.x); ay.y = fmaf(yv, dj.y, ay.y); ay.z = fmaf(yv, dj.z, ay.z); ay.w = fmaf(yv, dj.w, ay.w);
  }
  const float yself = Yt[G6_PIDX(d)];
  const float4 ri = *reinterpret_cast<const float4*>(Dt + i * G6_DS);
  const float4 oi = *reinterpret_cast<const float4*>(Ot + i * G6_DS);
  float4 dl;
  dl.x = ri.x - ax.x; dl.y = ri.y - ax.y; dl.z = ri.z - ax.z; dl.w = ri.w - ax.w;
  *reinterpret_cast<float4*>(Dt + i * G6_DS) = dl;
  const float out[4] = {oi.x + ay.x + yself * dl.x, oi.y + ay.y + yself * dl.y, oi.z + ay.z + yself * dl.z,
                        oi.w + ay.w + yself * dl.w};
  const i64 orow = ((i64)(bos + i) * HV + hv0 + ut) * GDN_V + v0 + uq * 4;
  uint2 packed;
  packed.x = (u32)from_f32<tin>(out[0]).bits | ((u32)from_f32<tin>(out[1]).bits << 16);
  packed.y = (u32)from_f32<tin>(out[2]).bits | ((u32)from_f32<tin>(out[3]).bits << 16);
  *reinterpret_cast<uint2*>(o + orow) = packed;
  if (delta_out != nullptr) *reinterpret_cast<float4*>(delta_out + orow) = dl;
}
