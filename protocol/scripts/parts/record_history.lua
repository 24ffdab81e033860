
local refused = fence(KEYS[1])
if refused then return refused end
local m = redis.call('HMGET', KEYS[1], 'slice_ms', 'retired')
if (not m[1]) or m[2] then return {2, 0} end
local n1 = tonumber(ARGV[6])
local k = 0
for i = 7, #ARGV - 1, 2 do
  local key = KEYS[2]
  if k >= n1 then key = KEYS[3] end
  redis.call('SETRANGE', key, tonumber(ARGV[i]), ARGV[i + 1])
  k = k + 1
end
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[3], ARGV[5])
return {1, k}
