from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0008_cycle_restored_from'),
    ]

    operations = [
        migrations.AddField(
            model_name='checkpoint',
            name='interference_s',
            field=models.FloatField(blank=True, null=True),
        ),
    ]
