
local t = redis.call('TIME')
local h = redis.call('HMGET', KEYS[1], 'rem', 'cap')
if not h[1] then
  local z = lazy_slice(KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3]), t)
  if z ~= 1 then return {z == -2 and -2 or -1, 0, 0, tonumber(t[1]), tonumber(t[2]), 0} end
  h = redis.call('HMGET', KEYS[1], 'rem', 'cap')
end
local rem = tonumber(h[1])
local rf = nil
if ARGV[4] and ARGV[4] ~= '' then
  rf = 'r:' .. ARGV[4]
  if redis.call('HEXISTS', KEYS[1], rf) == 1 then
    return {1, rem, tonumber(h[2]), tonumber(t[1]), tonumber(t[2]), 0}
  end
end
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local start = tonumber(ARGV[2])
local len = tonumber(ARGV[3])
local grace = math.min(math.floor(len / 4), 250)
if now < start - len or now > start + len + grace then
  return {-2, rem, tonumber(h[2]), tonumber(t[1]), tonumber(t[2]), 0}
end
local n = tonumber(ARGV[1])
if rem >= n then
  rem = redis.call('HINCRBY', KEYS[1], 'rem', -n)
  redis.call('HINCRBY', KEYS[1], 'adm', n)
  if rf then redis.call('HSET', KEYS[1], rf, n) end
  return {1, rem, tonumber(h[2]), tonumber(t[1]), tonumber(t[2]), 0}
end
redis.call('HINCRBY', KEYS[1], 'rej', n)
return {0, rem, tonumber(h[2]), tonumber(t[1]), tonumber(t[2]), 0}
