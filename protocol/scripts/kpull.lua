
-- KPULL: permits for keys of one keyed task in one slice. Every key's quota of the slice is a
-- field of ONE hash per task and slice, so a call costs the same few commands for 1 key or 64:
-- TIME, one HMGET, one HSET (and, for the slice's first call or a new key of a task with
-- overrides, one HMGET of the meta). See docs/protocol.md, "KPULL".
local t = redis.call('TIME')
local ts, tus = tonumber(t[1]), tonumber(t[2])
local now = ts * 1000 + math.floor(tus / 1000)
local start = tonumber(ARGV[1])
local len = tonumber(ARGV[2])
local grace = math.min(math.floor(len / 4), 250)
if now < start - len or now > start + len + grace then return {-2, ts, tus, 0} end
local n = (#ARGV - 7) / 2
if n ~= math.floor(n) or n > 1000 then
  return redis.error_reply('KPULL: two arguments (want, digest) per key, at most 1000 keys')
end
local q = 'q:' .. ARGV[3]
local rid = ARGV[4]
local f = {'cap', 'base', 'v', 'ko', 'len', q}
for i = 1, n do f[6 + i] = 'k:' .. ARGV[7 + 2 * i] end
local h = redis.call('HMGET', KEYS[1], unpack(f))
if h[6] then
  -- A resend of a call this host made (same request id): its answer, nothing taken again.
  local id, rest = string.match(h[6], '^([^|]*)|(.*)$')
  if id == rid then
    local out = {1, ts, tus, 0}
    for x in string.gmatch(rest, '%-?%d+') do out[#out + 1] = tonumber(x) end
    return out
  end
end
local fresh = not h[1]
if (not fresh) and tonumber(h[5]) ~= len and tonumber(ARGV[5]) <= (tonumber(h[3]) or 0) then
  -- Made for another slice length by a spec the caller has not moved past: re-read the meta.
  return {-3, ts, tus, tonumber(h[3]) or 0}
end
local cap, base, ko = tonumber(h[1]), tonumber(h[2]), h[4]
local missing = {}
for i = 1, n do
  if not h[6 + i] then missing[#missing + 1] = i end
end
local o = {}
local mver
if fresh or (#missing > 0 and ko ~= '0') then
  local mf = {'version', 'retired', 'keyed', 'threshold', 'ko_n'}
  for j, i in ipairs(missing) do mf[5 + j] = 'ko:' .. ARGV[7 + 2 * i] end
  local m = redis.call('HMGET', ARGV[7], unpack(mf))
  if (not m[1]) or m[2] or m[3] ~= '1' then return {-1, ts, tus, 0} end
  if tonumber(ARGV[5]) < tonumber(m[1]) then return {-3, ts, tus, tonumber(m[1])} end
  if fresh then
    cap = tonumber(redis.call('HGET', KEYS[2], 'cap'))
    if not cap then return {-1, ts, tus, 0} end
    base = tonumber(m[4]) or 0
    if m[5] == '0' then ko = '0' else ko = '1' end
    mver = m[1]
  end
  for j, i in ipairs(missing) do o[i] = tonumber(m[5 + j]) end
end
local aon = ARGV[6] == '1'
local out = {1, ts, tus, 0}
local rec = {}
local w = {}
if fresh then w = {'cap', cap, 'base', base, 'v', mver, 'ko', ko, 'len', len} end
local took = false
for i = 1, n do
  local want = tonumber(ARGV[6 + 2 * i]) or 0
  local d = 'k:' .. ARGV[7 + 2 * i]
  local rem, kcap
  local v = h[6 + i]
  if v then
    local r, c = string.match(v, '^(%-?%d+):(%d+)$')
    if r then rem, kcap = tonumber(r), tonumber(c) else rem, kcap = tonumber(v), cap end
  else
    kcap = cap
    if o[i] then
      if base > 0 then kcap = math.floor(o[i] * cap / base) else kcap = o[i] end
    end
    rem = kcap
  end
  local grant = 0
  if rem > 0 and want > 0 and ((not aon) or rem >= want) then
    grant = math.min(want, rem)
    rem = rem - grant
  end
  if grant > 0 or not v then
    w[#w + 1] = d
    if kcap == cap then w[#w + 1] = rem else w[#w + 1] = rem .. ':' .. kcap end
  end
  if grant > 0 then took = true end
  out[#out + 1] = grant; out[#out + 1] = rem; out[#out + 1] = kcap; out[#out + 1] = 0
  rec[#rec + 1] = grant .. ',' .. rem .. ',' .. kcap .. ',1'
end
if took then
  w[#w + 1] = q
  w[#w + 1] = rid .. '|' .. table.concat(rec, ',')
end
if #w > 0 then redis.call('HSET', KEYS[1], unpack(w)) end
if fresh then redis.call('PEXPIREAT', KEYS[1], start + 2 * len + 5000) end
return out
