
local refused, comparable = fence(KEYS[1])
if refused then return refused end
local v = tonumber(redis.call('HGET', KEYS[1], 'version'))
if comparable and ARGV[6] ~= '1' and v and v > tonumber(ARGV[5]) then return {5, v} end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'retired', ARGV[5])
claim(KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
for k = 2, #KEYS do redis.call('DEL', KEYS[k]) end
return {1, 0}
