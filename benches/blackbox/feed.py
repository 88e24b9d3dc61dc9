"""An independent AMQP client: 3 000 good envelopes (a fifth twice, same
message id) mixed with hostile messages, published with confirms."""
import json, os, random, sys, time, uuid, datetime
import pika

exchange, key = sys.argv[1], sys.argv[2]
random.seed(7)

def uuid7():
    ms = int(time.time() * 1000)
    rand = random.getrandbits(74)
    value = (ms << 80) | (0x7 << 76) | ((rand >> 62) << 64) | (0b10 << 62) | (rand & ((1 << 62) - 1))
    return str(uuid.UUID(int=value))

def envelope(i, extra=None):
    e = {"id": uuid7(), "routing_key": key,
         "occurred_at": datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z"),
         "payload": {"n": i}}
    if extra:
        e["payload"].update(extra)
    return e

conn = pika.BlockingConnection(pika.URLParameters("amqp://guest:guest@127.0.0.1:5672/%2f"))
ch = conn.channel()
ch.confirm_delivery()
def send(body, mid):
    props = pika.BasicProperties(message_id=mid, delivery_mode=2)
    ch.basic_publish(exchange, key, body, props)

good, dup, hostile = 0, 0, 0
for i in range(3000):
    e = envelope(i)
    body = json.dumps(e).encode()
    send(body, e["id"]); good += 1
    if i % 5 == 0:
        send(body, e["id"]); dup += 1
    if i % 100 == 0:
        bad = [
            (b"not json at all", None),
            (os.urandom(64), None),
            (json.dumps(envelope(i)).replace('"n": %d' % i, '"n": %d, "s": "\\u0000"' % i).encode(), "nul"),
            (json.dumps(envelope(i)).replace('"n": %d' % i, '"n": %d, "s": "\\ud800"' % i).encode(), "surrogate"),
            (json.dumps(envelope(i)).replace('"n": %d' % i, '"n": 1e1000000').encode(), "number"),
            (json.dumps(dict(envelope(i), id=str(uuid.uuid4()))).encode(), "v4"),
        ]
        for body, _ in bad:
            send(body, str(uuid.uuid4())); hostile += 1
conn.close()
print(json.dumps({"good": good, "duplicates": dup, "hostile": hostile}))
