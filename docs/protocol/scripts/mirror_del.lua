
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
local ok, doc = pcall(cjson.decode, cur)
local v = ok and type(doc) == 'table' and tonumber(doc.version) or nil
if v and v > tonumber(ARGV[2]) then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
