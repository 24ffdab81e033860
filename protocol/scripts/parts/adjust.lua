
local refused = fence(KEYS[1])
if refused then return refused end
local m = redis.call('HMGET', KEYS[1], 'slice_ms', 'retired')
if (not m[1]) or m[2] then return {2, 0} end
if ARGV[6] == '1' then redis.call('DEL', KEYS[2]) end
if #ARGV > 6 then
  local kv = {}
  for j = 7, #ARGV do kv[#kv + 1] = ARGV[j] end
  redis.call('HSET', KEYS[2], unpack(kv))
end
if ARGV[5] ~= '' then
  redis.call('LPUSH', KEYS[3], ARGV[5])
  redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[4]) - 1)
end
return {1, 0}
