
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
local MAX = 1000000000000
local q = 'q:' .. ARGV[3]
local rid = ARGV[4]
local ver = tonumber(ARGV[5]) or 0
local f = {'cap', 'base', 'v', 'ko', 'len', q}
for i = 1, n do f[6 + i] = 'k:' .. ARGV[7 + 2 * i] end
local h = redis.call('HMGET', KEYS[1], unpack(f))
if h[6] then
  -- A resend of a call this host made (same request id): its answer, nothing taken again.
  local id, rest = string.match(h[6], '^([^|]*)|(.*)$')
  if id == rid then
    local out = {1, ts, tus, 0}
    for x in string.gmatch(rest, '[^,]+') do out[#out + 1] = tonumber(x) end
    if #out == 4 + 4 * n then return out end
  end
end
local fresh = not h[1]
local hlen = tonumber(h[5])
if (not fresh) and hlen ~= len then
  -- Made for another slice length. A caller that has not moved past the spec that made it
  -- has a stale spec; a newer one shares it (the slice starts on both grids) and keeps it
  -- alive for the longer of the two.
  if ver <= (tonumber(h[3]) or 0) then return {-3, ts, tus, tonumber(h[3]) or 0} end
end
local longer = (not fresh) and hlen and len > hlen
local cap, base, ko = tonumber(h[1]), tonumber(h[2]), h[4]
local missing = {}
for i = 1, n do
  if not h[6 + i] then missing[#missing + 1] = i end
end
local o = {}
local mver
if fresh or (#missing > 0 and ko ~= '0') then
  local mf = {'version', 'retired', 'keyed', 'threshold', 'ko_n', 'proto', 'slice_ms'}
  for j, i in ipairs(missing) do mf[7 + j] = 'ko:' .. ARGV[7 + 2 * i] end
  local m = redis.call('HMGET', ARGV[7], unpack(mf))
  local mv = tonumber(m[1])
  if (not mv) or m[2] or m[3] ~= '1' then return {-1, ts, tus, 0} end
  if ver < mv then return {-3, ts, tus, mv} end
  if fresh then
    -- Made from a caller whose slice length is the spec's, never from a stale one.
    if tonumber(m[7]) ~= len then return {-3, ts, tus, mv} end
    cap = tonumber(redis.call('HGET', KEYS[2], 'cap'))
    if not cap then return {-1, ts, tus, 0} end
    base = tonumber(m[4]) or 0
    -- `ko_n` is written by managers of protocol 4 on; an older writer may have changed the
    -- overrides without it.
    if m[5] == '0' and (tonumber(m[6]) or 0) >= 4 then ko = '0' else ko = '1' end
    mver = m[1]
  end
  for j, i in ipairs(missing) do o[i] = tonumber(m[7 + j]) end
end
local aon = ARGV[6] == '1'
local out = {1, ts, tus, 0}
local rec = {}
local w = {}
if fresh then w = {'cap', cap, 'base', base, 'v', mver, 'ko', ko, 'len', len} end
local seen = {}
local took = false
for i = 1, n do
  local want = math.floor(tonumber(ARGV[6 + 2 * i]) or 0)
  local d = 'k:' .. ARGV[7 + 2 * i]
  local rem, kcap, new
  local s = seen[d]
  if s then
    -- The same key twice in one call: the second sees what the first left.
    rem, kcap, new = s[1], s[2], false
  elseif h[6 + i] then
    local v = h[6 + i]
    local r, c = string.match(v, '^(%-?%d+):(%d+)$')
    if r then
      rem, kcap = tonumber(r), tonumber(c)
    else
      -- A field that does not parse grants nothing (never more than was there).
      rem, kcap = tonumber(string.match(v, '^%-?%d+$')) or 0, cap
    end
    new = false
  else
    kcap = cap
    if o[i] then
      if base > 0 then kcap = math.floor(o[i] * cap / base) else kcap = o[i] end
    end
    kcap = math.min(math.max(kcap, 0), MAX)
    rem, new = kcap, true
  end
  local grant = 0
  if rem > 0 and want > 0 and ((not aon) or rem >= want) then
    grant = math.min(want, rem)
    rem = rem - grant
  end
  seen[d] = {rem, kcap}
  if grant > 0 or new then
    w[#w + 1] = d
    if kcap == cap then
      w[#w + 1] = string.format('%d', rem)
    else
      w[#w + 1] = string.format('%d:%d', rem, kcap)
    end
  end
  if grant > 0 then took = true end
  out[#out + 1] = grant; out[#out + 1] = rem; out[#out + 1] = kcap; out[#out + 1] = 0
  rec[#rec + 1] = string.format('%d,%d,%d,1', grant, rem, kcap)
end
if took then
  w[#w + 1] = q
  w[#w + 1] = rid .. '|' .. table.concat(rec, ',')
end
if #w > 0 then redis.call('HSET', KEYS[1], unpack(w)) end
if fresh or longer then redis.call('PEXPIREAT', KEYS[1], start + 2 * len + 5000) end
return out
