
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local start = tonumber(ARGV[1])
local len = tonumber(ARGV[2])
local grace = math.min(math.floor(len / 4), 250)
if now < start - len or now > start + len + grace then return {-2, tonumber(t[1]), tonumber(t[2]), 0} end
local pf = 'p:' .. ARGV[3]
local rid = ARGV[4]
local n = #KEYS - 1
local meta = ARGV[7]
local h = {}
local missing = false
for i = 1, n do
  h[i] = redis.call('HMGET', KEYS[i + 1], 'rem', 'cap', pf)
  if not h[i][1] then missing = true end
end
local tcap, base
if missing then
  local m = redis.call('HMGET', meta, 'version', 'retired', 'keyed', 'threshold')
  if (not m[1]) or m[2] or m[3] ~= '1' then return {-1, tonumber(t[1]), tonumber(t[2]), 0} end
  if tonumber(ARGV[5]) < tonumber(m[1]) then return {-3, tonumber(t[1]), tonumber(t[2]), tonumber(m[1])} end
  tcap = tonumber(redis.call('HGET', KEYS[1], 'cap'))
  if not tcap then return {-1, tonumber(t[1]), tonumber(t[2]), 0} end
  base = tonumber(m[4]) or 0
end
local out = {1, tonumber(t[1]), tonumber(t[2]), 0}
for i = 1, n do
  local want = tonumber(ARGV[5 + 3 * i])
  local k = KEYS[i + 1]
  local rem, cap
  local done = false
  if h[i][3] then
    local id, g = string.match(h[i][3], '^(.*):(%-?%d+)$')
    if id == rid then
      out[#out + 1] = tonumber(g); out[#out + 1] = tonumber(h[i][1]) or 0
      out[#out + 1] = tonumber(h[i][2]) or 0; out[#out + 1] = 1
      done = true
    end
  end
  if not done then
    if not h[i][1] then
      cap = tcap
      local o = tonumber(redis.call('HGET', meta, 'ko:' .. ARGV[6 + 3 * i]))
      if o then
        if base > 0 then cap = math.floor(o * tcap / base) else cap = o end
      end
      rem = cap
      redis.call('HSET', k, 'cap', cap, 'rem', cap, 'key', ARGV[7 + 3 * i])
      redis.call('PEXPIREAT', k, start + 2 * len + 5000)
    else
      rem = tonumber(h[i][1])
      cap = tonumber(h[i][2])
    end
    local grant = 0
    if rem > 0 and want > 0 and (ARGV[6] ~= '1' or rem >= want) then
      grant = math.min(want, rem)
      rem = redis.call('HINCRBY', k, 'rem', -grant)
    end
    redis.call('HSET', k, pf, rid .. ':' .. grant)
    out[#out + 1] = grant; out[#out + 1] = rem; out[#out + 1] = cap; out[#out + 1] = 0
  end
end
return out
