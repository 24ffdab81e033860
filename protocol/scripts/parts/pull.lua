
local t = redis.call('TIME')
local pf = 'p:' .. ARGV[4]
local h = redis.call('HMGET', KEYS[1], 'rem', 'cap', pf, 'pace', 'burst')
if not h[1] then
  local z = lazy_slice(KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3]), t)
  if z ~= 1 then return {z == -2 and -2 or -1, 0, 0, tonumber(t[1]), tonumber(t[2]), 0} end
  h = redis.call('HMGET', KEYS[1], 'rem', 'cap', pf, 'pace', 'burst')
end
local rem = tonumber(h[1])
local cap = tonumber(h[2])
if h[3] then
  local id, g = string.match(h[3], '^(.*):(%-?%d+)$')
  if id == ARGV[5] then return {tonumber(g), rem, cap, tonumber(t[1]), tonumber(t[2]), 1} end
end
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local start = tonumber(ARGV[2])
local len = tonumber(ARGV[3])
local grace = math.min(math.floor(len / 4), 250)
if now < start - len or now > start + len + grace then
  return {-2, rem, cap, tonumber(t[1]), tonumber(t[2]), 0}
end
local want = tonumber(ARGV[1])
local grant = 0
local avail, forfeit = paced_allowance({h[4], h[5]}, rem, cap, now, start, len)
if want > 0 and (avail > 0 or forfeit > 0) then
  grant = math.max(0, math.min(want, avail))
  rem = redis.call('HINCRBY', KEYS[1], 'rem', -(grant + forfeit))
end
redis.call('HSET', KEYS[1], pf, ARGV[5] .. ':' .. grant)
if #ARGV >= 11 then
  local f = {'adm', 'rej', 'ok', 'err', 'lat_sum_us', 'lat_n', 'wrej'}
  for j = 1, math.min(#ARGV - 5, 7) do
    local a = ARGV[j + 5]
    if string.match(a, '^-?%d+$') and tonumber(a) ~= 0 then
      redis.call('HINCRBY', KEYS[1], f[j], a)
    end
  end
end
return {grant, rem, cap, tonumber(t[1]), tonumber(t[2]), 0}
